// The agent-name pipeline of SPEC §5.
//
// Design notes. canonicalize() has two paths that must agree: a fast path for pure
// ASCII input (no ICU calls but a table lookup for the skeleton, built once from ICU's
// own skeletons of the single ASCII characters) and the general path through ICU. The
// unit tests compare both on random ASCII strings. Character positions in errors are
// reported as indexes into the caller's input (locate_in_input), not into the mapped
// string, so that `agent!` and `My Agent!` both point at the `!` the user typed.
// The UTS #39 checks run once through uspoof_check2 (uts39_checks); uts39_check() and the
// pipeline derive their reason from that one result, so the conformance test, which
// compares each check and the restriction level separately, exercises the same call.
// Restriction levels for other allowed sets (UTS #39 Identifier_Status=Allowed, which the
// conformance data also reports) use their own checkers, built once; the product's
// checker allows every code point.
#include "mep/canonical.hpp"

#include "mep/precis.hpp"
#include "mep/utf8.hpp"

#include <fmt/format.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/uclean.h>
#include <unicode/unistr.h>
#include <unicode/uniset.h>
#include <unicode/uscript.h>
#include <unicode/uspoof.h>
#include <unicode/utf8.h>
#include <unicode/uversion.h>

#include <array>
#include <mutex>
#include <stdexcept>

namespace mep {
namespace {

// ---- ICU spoof checker ----------------------------------------------------------------

struct Spoof {
  USpoofChecker* checker = nullptr;
  // Skeleton of each ASCII character, or empty when it is not pure ASCII (then the
  // fast path is not used for strings holding it).
  std::array<std::string, 128> ascii_skeleton;
  std::array<bool, 128> ascii_skeleton_ok{};

  Spoof() {
    UErrorCode st = U_ZERO_ERROR;
    checker = uspoof_open(&st);
    uspoof_setChecks(checker, USPOOF_RESTRICTION_LEVEL | USPOOF_MIXED_NUMBERS | USPOOF_INVISIBLE, &st);
    uspoof_setRestrictionLevel(checker, USPOOF_HIGHLY_RESTRICTIVE);
    if (U_FAILURE(st)) throw std::runtime_error("ICU spoof checker unavailable");
    for (int c = 0x20; c < 0x7F; ++c) {
      std::string one(1, static_cast<char>(c));
      std::string sk = skeleton_icu(one);
      bool ascii = true;
      for (unsigned char b : sk) ascii = ascii && b < 0x80;
      ascii_skeleton[c] = sk;
      ascii_skeleton_ok[c] = ascii && !sk.empty();
    }
  }

  std::string skeleton_icu(std::string_view utf8) const {
    UErrorCode st = U_ZERO_ERROR;
    std::string out(utf8.size() * 3 + 16, '\0');
    int32_t n = uspoof_getSkeletonUTF8(checker, 0, utf8.data(), static_cast<int32_t>(utf8.size()), out.data(),
                                       static_cast<int32_t>(out.size()), &st);
    if (st == U_BUFFER_OVERFLOW_ERROR) {
      st = U_ZERO_ERROR;
      out.assign(static_cast<std::size_t>(n) + 1, '\0');
      n = uspoof_getSkeletonUTF8(checker, 0, utf8.data(), static_cast<int32_t>(utf8.size()), out.data(),
                                 static_cast<int32_t>(out.size()), &st);
    }
    if (U_FAILURE(st)) return {};
    out.resize(static_cast<std::size_t>(n));
    return out;
  }

  // Skeleton of a string; uses the ASCII table when every byte allows it.
  std::string skeleton(std::string_view utf8) const {
    std::string out;
    out.reserve(utf8.size());
    for (unsigned char b : utf8) {
      if (b >= 0x80 || !ascii_skeleton_ok[b]) return skeleton_icu(utf8);
      out += ascii_skeleton[b];
    }
    return out;
  }
};

const Spoof& spoof() {
  static const Spoof s;
  return s;
}

// A checker that only computes the restriction level, with `allowed` as its allowed set.
struct LevelChecker {
  USpoofChecker* checker = nullptr;

  // ICU copies `allowed`.
  explicit LevelChecker(const icu::UnicodeSet& allowed) {
    UErrorCode st = U_ZERO_ERROR;
    checker = uspoof_open(&st);
    uspoof_setChecks(checker, USPOOF_RESTRICTION_LEVEL, &st);
    uspoof_setRestrictionLevel(checker, USPOOF_HIGHLY_RESTRICTIVE);
    uspoof_setAllowedUnicodeSet(checker, &allowed, &st);
    if (U_FAILURE(st)) throw std::runtime_error("ICU spoof checker unavailable");
  }
  LevelChecker(const LevelChecker&) = delete;
  LevelChecker& operator=(const LevelChecker&) = delete;
  ~LevelChecker() { uspoof_close(checker); }
};

icu::UnicodeSet allowed_set(AllowedSet which) {
  UErrorCode st = U_ZERO_ERROR;
  icu::UnicodeSet set;
  if (which == AllowedSet::all) {
    set.add(0, 0x10FFFF);
    return set;
  }
  set.addAll(*uspoof_getRecommendedUnicodeSet(&st));
  if (which == AllowedSet::identifier) set.addAll(*uspoof_getInclusionUnicodeSet(&st));
  if (U_FAILURE(st)) throw std::runtime_error("ICU spoof data unavailable");
  return set;
}

const LevelChecker& level_checker(AllowedSet which) {
  static const LevelChecker identifier(allowed_set(AllowedSet::identifier));
  static const LevelChecker recommended(allowed_set(AllowedSet::recommended));
  return which == AllowedSet::identifier ? identifier : recommended;
}

RestrictionLevel from_icu(URestrictionLevel l) {
  switch (l) {
  case USPOOF_ASCII:
    return RestrictionLevel::ascii;
  case USPOOF_SINGLE_SCRIPT_RESTRICTIVE:
    return RestrictionLevel::single_script_restrictive;
  case USPOOF_HIGHLY_RESTRICTIVE:
    return RestrictionLevel::highly_restrictive;
  case USPOOF_MODERATELY_RESTRICTIVE:
    return RestrictionLevel::moderately_restrictive;
  case USPOOF_MINIMALLY_RESTRICTIVE:
    return RestrictionLevel::minimally_restrictive;
  default:
    return RestrictionLevel::unrestrictive;
  }
}

// Runs `checker` (which must have USPOOF_RESTRICTION_LEVEL set) on `utf8`: the result
// bits and the level; nullopt when ICU reports an error.
std::optional<std::pair<int32_t, RestrictionLevel>> run_checker(const USpoofChecker* checker, std::string_view utf8) {
  UErrorCode st = U_ZERO_ERROR;
  icu::LocalUSpoofCheckResultPointer result(uspoof_openCheckResult(&st));
  if (U_FAILURE(st)) throw std::runtime_error("ICU spoof check result unavailable");
  int32_t bits = uspoof_check2UTF8(checker, utf8.data(), static_cast<int32_t>(utf8.size()), result.getAlias(), &st);
  if (U_FAILURE(st)) return std::nullopt;
  URestrictionLevel level = uspoof_getCheckResultRestrictionLevel(result.getAlias(), &st);
  if (U_FAILURE(st)) return std::nullopt;
  return std::pair{bits, from_icu(level)};
}

// ---- helpers -----------------------------------------------------------------------------

bool is_category(char32_t c, uint32_t mask) { return (U_GET_GC_MASK(static_cast<UChar32>(c)) & mask) != 0; }

std::vector<std::string> scripts_of(std::u32string_view s) {
  std::vector<int> codes;
  for (char32_t c : s) {
    UErrorCode st = U_ZERO_ERROR;
    int sc = uscript_getScript(static_cast<UChar32>(c), &st);
    if (sc == USCRIPT_COMMON || sc == USCRIPT_INHERITED) continue;
    bool seen = false;
    for (int k : codes) seen = seen || k == sc;
    if (!seen) codes.push_back(sc);
  }
  std::vector<std::string> out;
  for (int k : codes) out.emplace_back(uscript_getName(static_cast<UScriptCode>(k)));
  if (out.empty()) out.emplace_back("Common");
  return out;
}

// Maps index `j` of the mapped string back to an index into the input: each input code
// point is mapped on its own (spaces dropped, width map, lower case), the pieces are
// split where NFC may not combine across, and each piece's NFC is lined up with the
// mapped string.
std::size_t locate_in_input(std::u32string_view input, std::size_t lead, bool remove_spaces, std::size_t j) {
  struct Unit {
    char32_t cp;
    std::size_t origin;
  };
  std::vector<Unit> pre;
  for (std::size_t i = 0; i < input.size(); ++i) {
    char32_t c = input[i];
    if (remove_spaces && u_charType(static_cast<UChar32>(c)) == U_SPACE_SEPARATOR) continue;
    icu::UnicodeString piece(static_cast<UChar32>(precis::width_map(c)));
    piece.toLower(icu::Locale::getRoot());
    for (int32_t k = 0; k < piece.length(); k = piece.moveIndex32(k, 1))
      pre.push_back({static_cast<char32_t>(piece.char32At(k)), i});
  }
  UErrorCode st = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(st);
  std::size_t out_pos = 0;
  for (std::size_t s = 0; s < pre.size();) {
    std::size_t e = s + 1;
    while (e < pre.size() && !nfc->hasBoundaryBefore(static_cast<UChar32>(pre[e].cp))) ++e;
    std::u32string seg;
    for (std::size_t k = s; k < e; ++k) seg.push_back(pre[k].cp);
    std::size_t produced = precis::nfc(seg).size();
    if (j < out_pos + produced) return lead + (produced == e - s ? pre[s + (j - out_pos)].origin : pre[s].origin);
    out_pos += produced;
    s = e;
  }
  return lead + (input.empty() ? 0 : std::min(j, input.size() - 1));
}

NameError from_precis(const precis::Error& e, std::u32string_view input, std::size_t lead, bool remove_spaces) {
  NameError err{NameReason::disallowed_character, std::nullopt, std::nullopt, std::string(e.name)};
  if (e.name == "empty") {
    err.reason = NameReason::empty;
  } else if (e.name == "bidi_rule") {
    err.reason = NameReason::bidi_rule;
  } else {
    if (e.is_context_rule()) err.reason = NameReason::context_rule;
    err.codepoint = e.codepoint;
    err.index = locate_in_input(input, lead, remove_spaces, e.index);
  }
  return err;
}

NameError char_error(NameReason r, char32_t cp, std::size_t index) { return NameError{r, cp, index, {}}; }

// Step 4: letters, marks after a base, decimal digits, and - _ inside the name.
std::optional<std::size_t> policy_violation(std::u32string_view s) {
  bool after_base = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    char32_t c = s[i];
    if (is_category(c, U_GC_L_MASK) || is_category(c, U_GC_ND_MASK)) {
      after_base = true;
    } else if (is_category(c, U_GC_M_MASK)) {
      if (!after_base) return i;
    } else if ((c == U'-' || c == U'_') && i > 0 && i + 1 < s.size()) {
      after_base = false;
    } else {
      return i;
    }
  }
  return std::nullopt;
}

std::optional<NameReason> spoof_check(std::string_view utf8) {
  std::optional<Uts39Checks> c = uts39_checks(utf8);
  if (!c) return NameReason::invalid_utf8;
  if (!c->highly_restrictive) return NameReason::mixed_script;
  if (c->mixed_numbers) return NameReason::mixed_numbers;
  if (c->invisible) return NameReason::invisible_character;
  return std::nullopt;
}

// ASCII-only input: the same result as the general path without calling ICU.
expected<CanonicalName, NameError> canonicalize_ascii(std::string_view in) {
  for (std::size_t i = 0; i < in.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(in[i]);
    if (c < 0x20 || c == 0x7F) return make_unexpected(char_error(NameReason::disallowed_character, c, i));
  }
  std::size_t b = 0, e = in.size();
  while (b < e && in[b] == ' ') ++b;
  while (e > b && in[e - 1] == ' ') --e;
  if (b == e) return make_unexpected(NameError{NameReason::empty, {}, {}, {}});
  CanonicalName out;
  out.display_name.assign(in.substr(b, e - b));
  std::string& name = out.canonical_name;
  std::array<std::size_t, k_max_name_bytes> origin{};
  for (std::size_t i = b; i < e; ++i) {
    char c = in[i];
    if (c == ' ') continue;
    origin[name.size()] = i;
    name.push_back(c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c);
  }
  for (std::size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool ok =
        (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || ((c == '-' || c == '_') && i > 0 && i + 1 < name.size());
    if (!ok) return make_unexpected(char_error(NameReason::disallowed_character, static_cast<char32_t>(c), origin[i]));
  }
  if (name.size() > k_max_name_code_points) return make_unexpected(NameError{NameReason::too_long, {}, {}, {}});
  out.skeleton = spoof().skeleton(name);
  bool letters = false;
  for (char c : name) letters = letters || (c >= 'a' && c <= 'z');
  out.scripts.emplace_back(letters ? "Latin" : "Common");
  return out;
}

std::string show(std::u32string_view s) { return utf8::encode(s); }

} // namespace

std::string_view to_string(NameReason r) {
  switch (r) {
  case NameReason::empty:
    return "empty";
  case NameReason::too_long:
    return "too-long";
  case NameReason::invalid_utf8:
    return "invalid-utf8";
  case NameReason::disallowed_character:
    return "disallowed-character";
  case NameReason::context_rule:
    return "context-rule";
  case NameReason::bidi_rule:
    return "bidi-rule";
  case NameReason::mixed_script:
    return "mixed-script";
  case NameReason::mixed_numbers:
    return "mixed-numbers";
  case NameReason::invisible_character:
    return "invisible-character";
  }
  return "disallowed-character";
}

std::string format_codepoint(char32_t cp) { return fmt::format("U+{:04X}", static_cast<uint32_t>(cp)); }

std::string NameError::message() const {
  switch (reason) {
  case NameReason::empty:
    return "empty name";
  case NameReason::too_long:
    return fmt::format("name too long (at most {} bytes in, {} code points out)", k_max_name_bytes,
                       k_max_name_code_points);
  case NameReason::invalid_utf8:
    return fmt::format("invalid UTF-8 at byte {}", index.value_or(0));
  case NameReason::bidi_rule:
    return "violates the Bidi Rule (RFC 5893)";
  case NameReason::mixed_script:
    return "mixes scripts (UTS #39 Highly Restrictive)";
  case NameReason::mixed_numbers:
    return "mixes digits of different numbering systems";
  case NameReason::invisible_character:
    return "holds an invisible character sequence";
  case NameReason::disallowed_character:
  case NameReason::context_rule:
    break;
  }
  std::string what =
      reason == NameReason::context_rule ? "character not allowed in this context" : "disallowed character";
  if (!codepoint) return what;
  char32_t cp = *codepoint;
  std::string glyph;
  bool printable =
      !(u_charType(static_cast<UChar32>(cp)) == U_CONTROL_CHAR ||
        u_charType(static_cast<UChar32>(cp)) == U_FORMAT_CHAR || u_charType(static_cast<UChar32>(cp)) == U_UNASSIGNED ||
        u_charType(static_cast<UChar32>(cp)) == U_SURROGATE || is_category(cp, U_GC_Z_MASK | U_GC_M_MASK));
  if (printable) {
    glyph = " '";
    utf8::append(glyph, cp);
    glyph += "'";
  }
  return fmt::format("{} {}{} at index {}", what, format_codepoint(cp), glyph, index.value_or(0));
}

boost::json::object NameError::to_json() const {
  boost::json::object o;
  o["reason"] = to_string(reason);
  if (codepoint) o["codepoint"] = format_codepoint(*codepoint);
  if (index) o["index"] = static_cast<std::int64_t>(*index);
  return o;
}

Problem NameError::to_problem() const {
  Problem p(Code::invalid_name, "invalid agent name: " + message());
  for (auto& kv : to_json()) p.extensions[kv.key()] = kv.value();
  return p;
}

namespace {

// True when width mapping, toLower and NFC leave `s` (an NFC string) unchanged, so the
// RFC 8264 §7 re-application cannot change it.
bool mapping_is_identity(std::u32string_view s) {
  for (char32_t c : s) {
    if (c < 0x80) {
      if (c >= 'A' && c <= 'Z') return false;
      continue;
    }
    if (c >= 0xFF01 && c <= 0xFFEF) return false;
    if (u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CHANGES_WHEN_LOWERCASED)) return false;
  }
  return true;
}

// True when ICU's Highly Restrictive, mixed-numbers and invisible checks cannot fail on
// `s`: every code point has one Script value X (not Common, Inherited, Unknown; X is then
// in every Script_Extensions set) except ASCII digits, '-' and '_'; no other decimal
// digit; no combining mark; no code point whose NFD holds the same code point twice.
bool uts39_cannot_fail(std::u32string_view s) {
  UErrorCode st = U_ZERO_ERROR;
  const icu::Normalizer2* nfd = icu::Normalizer2::getNFDInstance(st);
  int script = -1;
  for (char32_t c : s) {
    if ((c >= '0' && c <= '9') || c == '-' || c == '_') continue;
    const auto cp = static_cast<UChar32>(c);
    if (is_category(c, U_GC_M_MASK | U_GC_ND_MASK)) return false;
    int sc = uscript_getScript(cp, &st);
    if (sc == USCRIPT_COMMON || sc == USCRIPT_INHERITED || sc == USCRIPT_UNKNOWN) return false;
    if (script >= 0 && sc != script) return false;
    script = sc;
    icu::UnicodeString d;
    if (c >= 0xC0 && nfd->getDecomposition(cp, d)) {
      UChar32 prev = -1;
      for (int32_t k = 0; k < d.length(); k = d.moveIndex32(k, 1)) {
        if (d.char32At(k) == prev) return false;
        prev = d.char32At(k);
      }
    }
  }
  return U_SUCCESS(st);
}

} // namespace

expected<CanonicalName, NameError> canonicalize(std::string_view utf8, std::vector<ExplainStep>* explain) {
  auto step = [&](std::string_view name, std::string value) {
    if (explain) explain->push_back({std::string(name), std::move(value)});
  };
  if (explain) step("input", std::string(utf8));
  // 1. 1–256 bytes of valid UTF-8 without control characters.
  if (utf8.empty()) return make_unexpected(NameError{NameReason::empty, {}, {}, {}});
  if (utf8.size() > k_max_name_bytes) return make_unexpected(NameError{NameReason::too_long, {}, {}, {}});
  if (!explain) {
    bool ascii = true;
    for (unsigned char c : utf8) ascii = ascii && c < 0x80;
    if (ascii) return canonicalize_ascii(utf8);
  }
  auto decoded = utf8::decode(utf8);
  if (!decoded) return make_unexpected(NameError{NameReason::invalid_utf8, {}, decoded.error(), {}});
  const std::u32string& in = *decoded;
  for (std::size_t i = 0; i < in.size(); ++i)
    if (u_charType(static_cast<UChar32>(in[i])) == U_CONTROL_CHAR)
      return make_unexpected(char_error(NameReason::disallowed_character, in[i], i));
  std::size_t b = 0, e = in.size();
  while (b < e && u_isUWhiteSpace(static_cast<UChar32>(in[b]))) ++b;
  while (e > b && u_isUWhiteSpace(static_cast<UChar32>(in[e - 1]))) --e;
  if (b == e) return make_unexpected(NameError{NameReason::empty, {}, {}, {}});
  std::u32string_view trimmed = std::u32string_view(in).substr(b, e - b);
  CanonicalName out;
  out.display_name = utf8::encode(precis::nfc(trimmed));
  if (explain) step("display_name (trimmed, NFC)", out.display_name);

  // 2. Remove space separators.
  std::u32string spaceless;
  for (char32_t c : trimmed)
    if (u_charType(static_cast<UChar32>(c)) != U_SPACE_SEPARATOR) spaceless.push_back(c);
  if (explain) step("spaces removed", show(spaceless));

  // 3. PRECIS UsernameCaseMapped.
  std::u32string mapped = precis::map_username_case_mapped(spaceless);
  if (explain) step("width-mapped, lower-cased, NFC", show(mapped));
  if (precis::has_rtl(mapped) && !precis::bidi_rule(mapped))
    return make_unexpected(NameError{NameReason::bidi_rule, {}, {}, "bidi_rule"});
  if (mapped.empty()) return make_unexpected(NameError{NameReason::empty, {}, {}, "empty"});
  if (auto err = precis::check_class(mapped, precis::StringClass::identifier))
    return make_unexpected(from_precis(*err, trimmed, b, true));
  // The profile must be idempotent on its own output (RFC 8264 §7).
  if (!mapping_is_identity(mapped) && precis::map_username_case_mapped(mapped) != mapped)
    return make_unexpected(NameError{NameReason::disallowed_character, {}, {}, "not_idempotent"});
  if (explain) step("PRECIS UsernameCaseMapped", "ok");

  // 4. Agent-name policy.
  if (auto at = policy_violation(mapped))
    return make_unexpected(
        char_error(NameReason::disallowed_character, mapped[*at], locate_in_input(trimmed, b, true, *at)));
  if (mapped.size() > k_max_name_code_points) return make_unexpected(NameError{NameReason::too_long, {}, {}, {}});
  out.canonical_name = utf8::encode(mapped);
  if (explain) step("agent-name policy", "ok");

  // 5. UTS #39 restriction level, digits, invisibles.
  if (auto r = uts39_cannot_fail(mapped) ? std::nullopt : spoof_check(out.canonical_name))
    return make_unexpected(NameError{*r, {}, {}, {}});
  if (explain) step("UTS #39 Highly Restrictive", "ok");

  // 6. Skeleton.
  out.skeleton = spoof().skeleton(out.canonical_name);
  out.scripts = scripts_of(mapped);
  if (explain) step("canonical_name", out.canonical_name);
  if (explain) step("skeleton", out.skeleton);
  return out;
}

expected<std::string, NameError> username_case_mapped(std::string_view utf8, std::vector<ExplainStep>* explain) {
  auto step = [&](std::string_view name, std::string value) {
    if (explain) explain->push_back({std::string(name), std::move(value)});
  };
  step("input", std::string(utf8));
  auto decoded = utf8::decode(utf8);
  if (!decoded) return make_unexpected(NameError{NameReason::invalid_utf8, {}, decoded.error(), {}});
  std::u32string mapped = precis::map_username_case_mapped(*decoded);
  step("width-mapped, lower-cased, NFC", show(mapped));
  if (precis::has_rtl(mapped) && !precis::bidi_rule(mapped))
    return make_unexpected(NameError{NameReason::bidi_rule, {}, {}, "bidi_rule"});
  if (mapped.empty()) return make_unexpected(NameError{NameReason::empty, {}, {}, "empty"});
  if (auto err = precis::check_class(mapped, precis::StringClass::identifier))
    return make_unexpected(from_precis(*err, *decoded, 0, false));
  step("canonical_name", show(mapped));
  return utf8::encode(mapped);
}

std::string confusable_skeleton(std::string_view utf8) { return spoof().skeleton(utf8); }

std::optional<NameReason> uts39_check(std::string_view utf8) { return spoof_check(utf8); }

std::optional<Uts39Checks> uts39_checks(std::string_view utf8) {
  auto r = run_checker(spoof().checker, utf8);
  if (!r) return std::nullopt;
  const auto [bits, level] = *r;
  return Uts39Checks{level, (bits & USPOOF_RESTRICTION_LEVEL) == 0, (bits & USPOOF_MIXED_NUMBERS) != 0,
                     (bits & USPOOF_INVISIBLE) != 0};
}

std::string_view to_string(RestrictionLevel level) {
  switch (level) {
  case RestrictionLevel::ascii:
    return "ASCII";
  case RestrictionLevel::single_script_restrictive:
    return "SINGLE_SCRIPT_RESTRICTIVE";
  case RestrictionLevel::highly_restrictive:
    return "HIGHLY_RESTRICTIVE";
  case RestrictionLevel::moderately_restrictive:
    return "MODERATELY_RESTRICTIVE";
  case RestrictionLevel::minimally_restrictive:
    return "MINIMALLY_RESTRICTIVE";
  case RestrictionLevel::unrestrictive:
    return "UNRESTRICTIVE";
  }
  return "UNRESTRICTIVE";
}

RestrictionLevel restriction_level(std::string_view utf8, AllowedSet allowed, std::u32string_view also_allowed) {
  std::optional<std::pair<int32_t, RestrictionLevel>> r;
  if (also_allowed.empty()) {
    r = run_checker(allowed == AllowedSet::all ? spoof().checker : level_checker(allowed).checker, utf8);
  } else {
    icu::UnicodeSet set = allowed_set(allowed);
    for (char32_t c : also_allowed) set.add(static_cast<UChar32>(c));
    LevelChecker checker(set);
    r = run_checker(checker.checker, utf8);
  }
  return r ? r->second : RestrictionLevel::unrestrictive;
}

std::string unicode_version() {
  static const std::string version = [] {
    UVersionInfo v;
    u_getUnicodeVersion(v);
    return fmt::format("{}.{}", v[0], v[1]);
  }();
  return version;
}

std::string icu_version() {
  static const std::string version = [] {
    UVersionInfo v;
    u_getVersion(v);
    return fmt::format("{}.{}", v[0], v[1]);
  }();
  return version;
}

} // namespace mep
