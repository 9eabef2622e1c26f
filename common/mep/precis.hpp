// PRECIS (RFC 8264) string classes and the UsernameCaseMapped profile (RFC 8265 §3.3),
// computed from ICU's Unicode properties: derived property values, the RFC 5892
// context rules and the RFC 5893 Bidi Rule.
#pragma once
#include "mep/expected.hpp"

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace mep::precis {

/// RFC 8264 §8 derived property values (ID_DIS and FREE_PVAL are one value: FREE_PVAL).
enum class Property : std::uint8_t { pvalid, free_pval, disallowed, unassigned, contextj, contexto };

/// The property of a code point and the RFC 8264 §9 category that decided it, named as
/// precis_i18n names it (`ascii7`, `letter_digits`, `has_compat`, `exceptions`, …).
struct Derived {
  Property property;
  std::string_view reason;
};

/// The derived property value of `cp` (any value 0..0x10FFFF).
Derived derived_property(char32_t cp);

/// The name of a property as the IANA registry spells it (`PVALID`, `ID_DIS`/`FREE_PVAL`, …).
std::string_view property_name(Property p);

enum class StringClass { identifier, freeform };

/// A PRECIS rejection. `name` is precis_i18n's reason without the `DISALLOWED/` prefix:
/// `empty`, `bidi_rule`, a category (`has_compat`, `symbols`, …) or a context-rule name
/// (`zero_width_joiner`, `middle_dot`, …). `codepoint`/`index` (code points into the
/// checked string) are set for per-character failures.
struct Error {
  std::string_view name;
  std::optional<char32_t> codepoint;
  std::size_t index = 0;

  /// True for the eight RFC 5892 context-rule names.
  bool is_context_rule() const;
};

/// Checks every code point of `s` against the string class, left to right, applying the
/// CONTEXTJ/CONTEXTO rules at their position. The first failure is returned.
std::optional<Error> check_class(std::u32string_view s, StringClass cls);

/// True when `s` holds a code point of Bidi_Class R, AL or AN.
bool has_rtl(std::u32string_view s);
/// The six conditions of RFC 5893 §2 on `s` (non-empty).
bool bidi_rule(std::u32string_view s);

/// RFC 8265 §3.3 width mapping of one code point: U+FF01..U+FFEF to its NFKC form when
/// that is a single code point; every other code point maps to itself.
char32_t width_map(char32_t cp);

/// RFC 8265 §3.3 mapping: width mapping (U+FF01..U+FFEF to their single-code-point
/// compatibility form), toLowerCase (root locale), NFC.
std::u32string map_username_case_mapped(std::u32string_view s);

/// The whole UsernameCaseMapped profile: mapping, then the Bidi Rule (only when the
/// string holds R/AL/AN code points), emptiness, and the IdentifierClass, in
/// precis_i18n's order. Returns the enforced string or the first error.
expected<std::u32string, Error> enforce_username_case_mapped(std::u32string_view s);

/// NFC of `s`.
std::u32string nfc(std::u32string_view s);

} // namespace mep::precis
