// RFC 8264 derived properties and RFC 8265 UsernameCaseMapped on ICU.
//
// Design notes. The derived property of a code point is computed from ICU's character
// properties exactly in the order of RFC 8264 §8 (derived_property_uncached) and cached in
// a 1.1 MB table of atomic bytes filled on first use, so each code point is computed once
// per process and lookups are lock-free. The context rules follow RFC 5892 Appendix A;
// the katakana-middle-dot and Arabic-Indic rules look at the whole string, the others at
// their neighbours. Enforcement follows precis_i18n's order (map, Bidi Rule if RTL,
// empty, class) so that error names match the conformance data.
#include "mep/precis.hpp"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/uscript.h>

#include <array>
#include <atomic>
#include <memory>
#include <stdexcept>

namespace mep::precis {
namespace {

constexpr std::array<std::string_view, 15> k_reasons = {"exceptions",
                                                        "backward_compatible",
                                                        "unassigned",
                                                        "ascii7",
                                                        "join_control",
                                                        "old_hangul_jamo",
                                                        "precis_ignorable_properties",
                                                        "controls",
                                                        "has_compat",
                                                        "letter_digits",
                                                        "other_letter_digits",
                                                        "spaces",
                                                        "symbols",
                                                        "punctuation",
                                                        "other"};

enum Reason : std::uint8_t {
  r_exceptions,
  r_backward_compatible,
  r_unassigned,
  r_ascii7,
  r_join_control,
  r_old_hangul_jamo,
  r_ignorable,
  r_controls,
  r_has_compat,
  r_letter_digits,
  r_other_letter_digits,
  r_spaces,
  r_symbols,
  r_punctuation,
  r_other
};

const icu::Normalizer2& nfc_instance() {
  static const icu::Normalizer2* n = [] {
    UErrorCode st = U_ZERO_ERROR;
    const icu::Normalizer2* p = icu::Normalizer2::getNFCInstance(st);
    if (U_FAILURE(st)) throw std::runtime_error("ICU NFC data unavailable");
    return p;
  }();
  return *n;
}

const icu::Normalizer2& nfkc_instance() {
  static const icu::Normalizer2* n = [] {
    UErrorCode st = U_ZERO_ERROR;
    const icu::Normalizer2* p = icu::Normalizer2::getNFKCInstance(st);
    if (U_FAILURE(st)) throw std::runtime_error("ICU NFKC data unavailable");
    return p;
  }();
  return *n;
}

bool is_noncharacter(char32_t cp) { return (cp & 0xFFFE) == 0xFFFE || (cp >= 0xFDD0 && cp <= 0xFDEF); }

// RFC 5892 §2.6 exceptions.
std::optional<Property> exception_property(char32_t cp) {
  switch (cp) {
  case 0x00DF:
  case 0x03C2:
  case 0x06FD:
  case 0x06FE:
  case 0x0F0B:
  case 0x3007:
    return Property::pvalid;
  case 0x00B7:
  case 0x0375:
  case 0x05F3:
  case 0x05F4:
  case 0x30FB:
    return Property::contexto;
  case 0x0640:
  case 0x07FA:
  case 0x302E:
  case 0x302F:
  case 0x3031:
  case 0x3032:
  case 0x3033:
  case 0x3034:
  case 0x3035:
  case 0x303B:
    return Property::disallowed;
  default:
    if ((cp >= 0x0660 && cp <= 0x0669) || (cp >= 0x06F0 && cp <= 0x06F9)) return Property::contexto;
    return std::nullopt;
  }
}

bool has_compat(char32_t cp) {
  UErrorCode st = U_ZERO_ERROR;
  icu::UnicodeString s(static_cast<UChar32>(cp));
  return !nfkc_instance().isNormalized(s, st);
}

std::pair<Property, Reason> derived_property_uncached(char32_t cp) {
  const auto gc = static_cast<UCharCategory>(u_charType(static_cast<UChar32>(cp)));
  if (auto p = exception_property(cp)) return {*p, r_exceptions};
  // BackwardCompatible is empty (RFC 8264 §9.7).
  if (gc == U_UNASSIGNED && !is_noncharacter(cp)) return {Property::unassigned, r_unassigned};
  if (cp >= 0x21 && cp <= 0x7E) return {Property::pvalid, r_ascii7};
  if (cp == 0x200C || cp == 0x200D) return {Property::contextj, r_join_control};
  switch (u_getIntPropertyValue(static_cast<UChar32>(cp), UCHAR_HANGUL_SYLLABLE_TYPE)) {
  case U_HST_LEADING_JAMO:
  case U_HST_VOWEL_JAMO:
  case U_HST_TRAILING_JAMO:
    return {Property::disallowed, r_old_hangul_jamo};
  default:
    break;
  }
  if (u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_DEFAULT_IGNORABLE_CODE_POINT) || is_noncharacter(cp))
    return {Property::disallowed, r_ignorable};
  if (gc == U_CONTROL_CHAR) return {Property::disallowed, r_controls};
  if (has_compat(cp)) return {Property::free_pval, r_has_compat};
  switch (gc) {
  case U_LOWERCASE_LETTER:
  case U_UPPERCASE_LETTER:
  case U_OTHER_LETTER:
  case U_DECIMAL_DIGIT_NUMBER:
  case U_MODIFIER_LETTER:
  case U_NON_SPACING_MARK:
  case U_COMBINING_SPACING_MARK:
    return {Property::pvalid, r_letter_digits};
  case U_TITLECASE_LETTER:
  case U_LETTER_NUMBER:
  case U_OTHER_NUMBER:
  case U_ENCLOSING_MARK:
    return {Property::free_pval, r_other_letter_digits};
  case U_SPACE_SEPARATOR:
    return {Property::free_pval, r_spaces};
  case U_MATH_SYMBOL:
  case U_CURRENCY_SYMBOL:
  case U_MODIFIER_SYMBOL:
  case U_OTHER_SYMBOL:
    return {Property::free_pval, r_symbols};
  case U_CONNECTOR_PUNCTUATION:
  case U_DASH_PUNCTUATION:
  case U_START_PUNCTUATION:
  case U_END_PUNCTUATION:
  case U_INITIAL_PUNCTUATION:
  case U_FINAL_PUNCTUATION:
  case U_OTHER_PUNCTUATION:
    return {Property::free_pval, r_punctuation};
  default:
    return {Property::disallowed, r_other};
  }
}

// Cache entry: 0 = not computed; else 0x80 | property << 4 | reason.
std::atomic<std::uint8_t> g_cache[0x110000];

int script_of(char32_t cp) {
  UErrorCode st = U_ZERO_ERROR;
  return uscript_getScript(static_cast<UChar32>(cp), &st);
}

int joining_type(char32_t cp) { return u_getIntPropertyValue(static_cast<UChar32>(cp), UCHAR_JOINING_TYPE); }

bool is_virama(char32_t cp) { return u_getCombiningClass(static_cast<UChar32>(cp)) == 9; }

bool arabic_indic(char32_t cp) { return cp >= 0x0660 && cp <= 0x0669; }
bool extended_arabic_indic(char32_t cp) { return cp >= 0x06F0 && cp <= 0x06F9; }

// RFC 5892 A.1: (Joining_Type:{L,D})(Joining_Type:T)*\u200C(Joining_Type:T)*(Joining_Type:{R,D})
bool valid_join_context(std::u32string_view s, std::size_t i) {
  auto scan = [](auto begin, auto end, int term) {
    for (auto it = begin; it != end; ++it) {
      int jt = joining_type(*it);
      if (jt == term || jt == U_JT_DUAL_JOINING) return true;
      if (jt != U_JT_TRANSPARENT) return false;
    }
    return false;
  };
  auto before = s.substr(0, i);
  auto after = s.substr(i + 1);
  return scan(before.rbegin(), before.rend(), U_JT_LEFT_JOINING) &&
         scan(after.begin(), after.end(), U_JT_RIGHT_JOINING);
}

// Returns the failing rule's name, or an empty view when the context allows `s[i]`.
std::string_view context_rule_error(std::u32string_view s, std::size_t i) {
  const char32_t cp = s[i];
  const bool has_before = i > 0;
  const bool has_after = i + 1 < s.size();
  if (arabic_indic(cp)) {
    for (char32_t c : s)
      if (extended_arabic_indic(c)) return "arabic_indic";
    return {};
  }
  if (extended_arabic_indic(cp)) {
    for (char32_t c : s)
      if (arabic_indic(c)) return "extended_arabic_indic";
    return {};
  }
  switch (cp) {
  case 0x200C:
    if (has_before && is_virama(s[i - 1])) return {};
    if (valid_join_context(s, i)) return {};
    return "zero_width_nonjoiner";
  case 0x200D:
    return has_before && is_virama(s[i - 1]) ? std::string_view{} : "zero_width_joiner";
  case 0x00B7:
    return has_before && has_after && s[i - 1] == 0x6C && s[i + 1] == 0x6C ? std::string_view{} : "middle_dot";
  case 0x0375:
    return has_after && script_of(s[i + 1]) == USCRIPT_GREEK ? std::string_view{} : "greek_keraia";
  case 0x05F3:
  case 0x05F4:
    return has_before && script_of(s[i - 1]) == USCRIPT_HEBREW ? std::string_view{} : "hebrew_punctuation";
  case 0x30FB:
    for (char32_t c : s) {
      int sc = script_of(c);
      if (sc == USCRIPT_HIRAGANA || sc == USCRIPT_KATAKANA || sc == USCRIPT_HAN) return {};
    }
    return "katakana_middle_dot";
  default:
    return "context"; // a CONTEXTO/J code point without a rule: never valid
  }
}

std::u32string to_u32(const icu::UnicodeString& us) {
  std::u32string out(static_cast<std::size_t>(us.countChar32()), U'\0');
  UErrorCode st = U_ZERO_ERROR;
  int32_t n = us.toUTF32(reinterpret_cast<UChar32*>(out.data()), static_cast<int32_t>(out.size()), st);
  out.resize(static_cast<std::size_t>(n));
  return out;
}

icu::UnicodeString from_u32(std::u32string_view s) {
  return icu::UnicodeString::fromUTF32(reinterpret_cast<const UChar32*>(s.data()), static_cast<int32_t>(s.size()));
}

} // namespace

Derived derived_property(char32_t cp) {
  if (cp > 0x10FFFF) return {Property::disallowed, k_reasons[r_other]};
  std::uint8_t e = g_cache[cp].load(std::memory_order_relaxed);
  if (!e) {
    auto [p, r] = derived_property_uncached(cp);
    e = static_cast<std::uint8_t>(0x80 | static_cast<int>(p) << 4 | r);
    g_cache[cp].store(e, std::memory_order_relaxed);
  }
  return {static_cast<Property>(e >> 4 & 0x7), k_reasons[e & 0xF]};
}

std::string_view property_name(Property p) {
  switch (p) {
  case Property::pvalid:
    return "PVALID";
  case Property::free_pval:
    return "FREE_PVAL";
  case Property::disallowed:
    return "DISALLOWED";
  case Property::unassigned:
    return "UNASSIGNED";
  case Property::contextj:
    return "CONTEXTJ";
  case Property::contexto:
    return "CONTEXTO";
  }
  return "DISALLOWED";
}

bool Error::is_context_rule() const {
  static constexpr std::string_view k_rules[] = {"zero_width_joiner", "zero_width_nonjoiner",  "middle_dot",
                                                 "greek_keraia",      "hebrew_punctuation",    "katakana_middle_dot",
                                                 "arabic_indic",      "extended_arabic_indic", "context"};
  for (auto r : k_rules)
    if (name == r) return true;
  return false;
}

std::optional<Error> check_class(std::u32string_view s, StringClass cls) {
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char32_t cp = s[i];
    if (cp >= 0x21 && cp <= 0x7E) continue; // ascii7: PVALID in both classes
    Derived d = derived_property(cp);
    if (d.property == Property::pvalid) continue;
    if (d.property == Property::free_pval && cls == StringClass::freeform) continue;
    if (d.property == Property::contextj || d.property == Property::contexto) {
      std::string_view rule = context_rule_error(s, i);
      if (rule.empty()) continue;
      return Error{rule, cp, i};
    }
    return Error{d.reason, cp, i};
  }
  return std::nullopt;
}

bool has_rtl(std::u32string_view s) {
  for (char32_t c : s) {
    if (c < 0x0590) continue;
    auto d = u_charDirection(static_cast<UChar32>(c));
    if (d == U_RIGHT_TO_LEFT || d == U_RIGHT_TO_LEFT_ARABIC || d == U_ARABIC_NUMBER) return true;
  }
  return false;
}

bool bidi_rule(std::u32string_view s) {
  if (s.empty()) return false;
  auto dir = [](char32_t c) { return u_charDirection(static_cast<UChar32>(c)); };
  const auto first = dir(s[0]);
  const bool ltr = first == U_LEFT_TO_RIGHT;
  const bool rtl = first == U_RIGHT_TO_LEFT || first == U_RIGHT_TO_LEFT_ARABIC;
  if (!ltr && !rtl) return false; // condition 1
  auto allowed = [&](UCharDirection d) {
    switch (d) {
    case U_EUROPEAN_NUMBER:
    case U_EUROPEAN_NUMBER_SEPARATOR:
    case U_COMMON_NUMBER_SEPARATOR:
    case U_EUROPEAN_NUMBER_TERMINATOR:
    case U_OTHER_NEUTRAL:
    case U_BOUNDARY_NEUTRAL:
    case U_DIR_NON_SPACING_MARK:
      return true;
    case U_LEFT_TO_RIGHT:
      return ltr;
    case U_RIGHT_TO_LEFT:
    case U_RIGHT_TO_LEFT_ARABIC:
    case U_ARABIC_NUMBER:
      return rtl;
    default:
      return false;
    }
  };
  // Conditions 3 and 6: the last character that is not NSM.
  std::size_t last = s.size();
  while (last > 0 && dir(s[last - 1]) == U_DIR_NON_SPACING_MARK) --last;
  if (last == 0) return false;
  const auto end = dir(s[last - 1]);
  if (ltr && end != U_LEFT_TO_RIGHT && end != U_EUROPEAN_NUMBER) return false;
  if (rtl && end != U_RIGHT_TO_LEFT && end != U_RIGHT_TO_LEFT_ARABIC && end != U_EUROPEAN_NUMBER &&
      end != U_ARABIC_NUMBER)
    return false;
  // Conditions 2 and 5, and 4 for RTL: EN and AN exclusive.
  bool seen_en = false, seen_an = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto d = dir(s[i]);
    if (i > 0 && !allowed(d)) return false;
    seen_en = seen_en || d == U_EUROPEAN_NUMBER;
    seen_an = seen_an || d == U_ARABIC_NUMBER;
  }
  return !(rtl && seen_en && seen_an);
}

std::u32string nfc(std::u32string_view s) {
  UErrorCode st = U_ZERO_ERROR;
  icu::UnicodeString us = from_u32(s);
  if (nfc_instance().isNormalized(us, st)) return std::u32string(s);
  st = U_ZERO_ERROR;
  return to_u32(nfc_instance().normalize(us, st));
}

char32_t width_map(char32_t cp) {
  if (cp < 0xFF01 || cp > 0xFFEF) return cp;
  UErrorCode st = U_ZERO_ERROR;
  icu::UnicodeString n = nfkc_instance().normalize(icu::UnicodeString(static_cast<UChar32>(cp)), st);
  if (U_SUCCESS(st) && n.countChar32() == 1) return static_cast<char32_t>(n.char32At(0));
  return cp;
}

std::u32string map_username_case_mapped(std::u32string_view s) {
  std::u32string widened(s);
  for (char32_t& c : widened) c = width_map(c);
  icu::UnicodeString us = from_u32(widened);
  us.toLower(icu::Locale::getRoot());
  UErrorCode st = U_ZERO_ERROR;
  if (!nfc_instance().isNormalized(us, st)) {
    st = U_ZERO_ERROR;
    us = nfc_instance().normalize(us, st);
  }
  return to_u32(us);
}

expected<std::u32string, Error> enforce_username_case_mapped(std::u32string_view s) {
  std::u32string mapped = map_username_case_mapped(s);
  if (has_rtl(mapped) && !bidi_rule(mapped)) return make_unexpected(Error{"bidi_rule", {}, 0});
  if (mapped.empty()) return make_unexpected(Error{"empty", {}, 0});
  if (auto err = check_class(mapped, StringClass::identifier)) return make_unexpected(*err);
  return mapped;
}

} // namespace mep::precis
