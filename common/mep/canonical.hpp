// Agent names (SPEC §5): trimming, space removal, PRECIS UsernameCaseMapped, the
// agent-name policy, UTS #39 restriction checks and the confusable skeleton.
#pragma once
#include "mep/expected.hpp"
#include "mep/problem.hpp"

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mep {

/// The `reason` of an invalid name (SPEC §5).
enum class NameReason {
  empty,
  too_long,
  invalid_utf8,
  disallowed_character,
  context_rule,
  bidi_rule,
  mixed_script,
  mixed_numbers,
  invisible_character,
};

/// `"disallowed-character"` etc.
std::string_view to_string(NameReason r);

/// Why a name was rejected. `codepoint` and `index` are set for a character: `index`
/// counts code points of the input as given (bytes for `invalid-utf8`). `precis_error`
/// is the fine-grained PRECIS name (`has_compat`, `zero_width_joiner`, …) when the
/// PRECIS step rejected the name.
struct NameError {
  NameReason reason;
  std::optional<char32_t> codepoint;
  std::optional<std::size_t> index;
  std::string precis_error;

  /// One line for people: `disallowed character U+0021 '!' at index 5`.
  std::string message() const;
  /// `422 invalid-name` with `reason`, `codepoint` ("U+0021") and `index` members.
  Problem to_problem() const;
  /// `{"reason": …, "codepoint": "U+0021", "index": 5}`.
  boost::json::object to_json() const;
};

/// A valid agent name.
struct CanonicalName {
  std::string display_name;         ///< NFC, outer whitespace trimmed
  std::string canonical_name;       ///< what users see and the API returns
  std::string skeleton;             ///< UTS #39 skeleton; uniqueness among live leases is on it
  std::vector<std::string> scripts; ///< Unicode script names, e.g. {"Latin"}
};

/// One step of the pipeline for `--explain`.
struct ExplainStep {
  std::string step;
  std::string value;
};

enum class Profile { agent, username_case_mapped };

inline constexpr std::size_t k_max_name_bytes = 256;
inline constexpr std::size_t k_max_name_code_points = 64;

/// The whole agent-name pipeline of SPEC §5 on UTF-8 input. Thread-safe. When
/// `explain` is given, each step's result is appended to it.
expected<CanonicalName, NameError> canonicalize(std::string_view utf8, std::vector<ExplainStep>* explain = nullptr);

/// RFC 8265 UsernameCaseMapped alone (no trimming, space removal, policy or UTS #39):
/// the enforced string in UTF-8.
expected<std::string, NameError> username_case_mapped(std::string_view utf8,
                                                      std::vector<ExplainStep>* explain = nullptr);

/// The UTS #39 skeleton of UTF-8 text (ICU's spoof checker; invalid UTF-8 is replaced).
std::string confusable_skeleton(std::string_view utf8);

/// The UTS #39 restriction-level checks on UTF-8 text; nullopt when it passes Highly
/// Restrictive, has no mixed digit systems and no invisible characters. The first failing
/// check names the reason (restriction level, then digits, then invisibles).
std::optional<NameReason> uts39_check(std::string_view utf8);

/// UTS #39 §5.2 restriction levels, most restrictive first, in ICU's order
/// (URestrictionLevel).
enum class RestrictionLevel {
  ascii,
  single_script_restrictive,
  highly_restrictive,
  moderately_restrictive,
  minimally_restrictive,
  unrestrictive,
};

/// ICU's name without the `USPOOF_` prefix: `"ASCII"`, `"HIGHLY_RESTRICTIVE"`, …
std::string_view to_string(RestrictionLevel level);

/// The characters a restriction-level computation allows (UTS #39 §5.2 step 1: a string
/// holding any other character is UNRESTRICTIVE).
enum class AllowedSet {
  all,         ///< every code point: ICU's default checker, the one uts39_check() uses
  identifier,  ///< UTS #39 Identifier_Status=Allowed: ICU's recommended ∪ inclusion sets
  recommended, ///< uspoof_getRecommendedSet() alone
};

/// The most restrictive level UTF-8 text meets, as ICU's spoof checker computes it for
/// the given allowed set plus the code points `also_allowed`. The three sets alone use
/// checkers built once; a non-empty `also_allowed` builds a checker for the call.
RestrictionLevel restriction_level(std::string_view utf8, AllowedSet allowed = AllowedSet::all,
                                   std::u32string_view also_allowed = {});

/// Each check of uts39_check() on its own, from the same checker and the same call.
struct Uts39Checks {
  RestrictionLevel level;  ///< every code point allowed
  bool highly_restrictive; ///< level is ASCII, single-script or highly restrictive
  bool mixed_numbers;      ///< fails: decimal digits of more than one system
  bool invisible;          ///< fails: a non-spacing mark twice in one combining sequence
};

/// The UTS #39 checks on UTF-8 text. ICU checks ill-formed sequences as U+FFFD; nullopt
/// only when ICU reports an error.
std::optional<Uts39Checks> uts39_checks(std::string_view utf8);

/// Unicode and ICU versions the skeletons are computed with ("15.0", "72.1").
std::string unicode_version();
std::string icu_version();

/// `U+0021`.
std::string format_codepoint(char32_t cp);

} // namespace mep
