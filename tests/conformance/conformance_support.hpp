// Support for the PRECIS / UTS #39 conformance test: reading the shared data in place,
// UTF-8 helpers, the exclusion list and the per-file report of mismatches.
#pragma once
#include <boost/json.hpp>

#include <cstddef>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace conformance {

/// `${MEP_CONFORMANCE_DIR}/precis` (tests/conformance/data/precis by default).
std::filesystem::path data_dir();

/// The whole file; throws when it cannot be read.
std::string read_file(const std::filesystem::path& p);

/// Splits on '\n' only (U+0085, U+2028 and U+2029 occur raw inside strings). A final
/// empty line is dropped. Each line comes with its 1-based number.
std::vector<std::pair<std::size_t, std::string_view>> split_lines(std::string_view text);

/// True when a JSON line holds a `\uD800`..`\uDFFF` escape that is not part of a
/// surrogate pair: such a string cannot be UTF-8 (two precis_i18n golden inputs).
bool has_lone_surrogate_escape(std::string_view json_line);

/// A code point in hex without prefix (`"1F600"`); throws when it is not one.
char32_t parse_hex(std::string_view s);

/// Strict UTF-8 decoding; nullopt when ill-formed.
std::optional<std::u32string> decode(std::string_view utf8);
std::string encode(std::u32string_view s);

/// `U+0061 U+0301`; `(empty)` for "".
std::string code_points(std::string_view utf8);

/// How a value is printed in a mismatch and spelled in exclusions.json: `null`, a quoted
/// string when it is printable ASCII (`"abc"`), else its code points (`U+00E9 U+0301`).
std::string show(const std::optional<std::string>& utf8);
std::string show(bool b);

/// Parsed code-point ranges (`"0CF3"`, `"10EFD..10EFF"`).
class CodePointRanges {
public:
  void add(char32_t first, char32_t last) { m_ranges.emplace_back(first, last); }
  bool contains(char32_t cp) const;
  /// The first code point of `utf8` in a range.
  std::optional<char32_t> first_in(std::string_view utf8) const;
  std::size_t size() const;

private:
  std::vector<std::pair<char32_t, char32_t>> m_ranges;
};

/// The code points new in Unicode 15.0 from `unicode_version_exclusions.json`.
const CodePointRanges& new_in_unicode_15();

/// Field access that throws a readable error for malformed records.
const boost::json::value& at(const boost::json::object& o, std::string_view key);
std::optional<std::string> string_or_null(const boost::json::object& o, std::string_view key);
std::string string_field(const boost::json::object& o, std::string_view key);
bool bool_field(const boost::json::object& o, std::string_view key);

/// One difference between the data and mep.
struct Mismatch {
  std::string record;    ///< id, `<profile> <code points of input>`, or `U+XXXX[..U+YYYY]`
  std::size_t line = 0;  ///< line of the data file (0 for none)
  std::string codepoint; ///< the code point concerned, when one is (`U+FDC8`)
  std::string field;     ///< what was compared (`output`, `error`, `skeleton`, …)
  std::string expected;  ///< show() of the data's value
  std::string got;       ///< show() of mep's value
  std::string context;   ///< extra detail for the reader (input code points, profile)
};

/// tests/conformance/exclusions.json: known differences, each with the record, the code
/// point and the Unicode-version reason. An entry matches a mismatch with the same file,
/// record, field, expected and got.
class Exclusions {
public:
  struct Entry {
    std::string file, record, codepoint, field, expected, got, reason;
    std::size_t matched = 0;
  };

  /// Loads and validates the list; problems (missing fields, unknown files) are
  /// collected in errors().
  explicit Exclusions(const std::filesystem::path& p);

  /// True (and the entry is marked used) when the list names `m`.
  bool excludes(std::string_view file, const Mismatch& m);
  /// The entries for `file` that matched nothing.
  std::vector<const Entry*> unused(std::string_view file) const;
  std::size_t count(std::string_view file) const;
  const std::vector<std::string>& errors() const { return m_errors; }
  const std::vector<Entry>& entries() const { return m_entries; }

private:
  std::vector<Entry> m_entries;
  std::vector<std::string> m_errors;
};

/// The data files the test knows; every other file of the data directory except
/// README.md, LICENSES/ and tools/ makes the coverage test fail.
const std::vector<std::string>& known_data_files();

/// The shared exclusion list, loaded once.
Exclusions& exclusions();

/// Counts and mismatches of one data file. finish() prints the summary, every mismatch
/// not on the exclusion list, and every stale exclusion; it returns the number of
/// failures (mismatches not excluded + stale exclusions).
class FileReport {
public:
  explicit FileReport(std::string file);

  void checked(std::size_t n = 1) { m_checked += n; }
  void skipped(const std::string& why, std::size_t n = 1) { m_skipped[why] += n; }
  /// Informational tallies (documented divergences that are accepted by rule).
  void note(const std::string& what, std::size_t n = 1) { m_notes[what] += n; }
  void mismatch(Mismatch m);
  std::size_t finish();

private:
  std::string m_file;
  std::size_t m_checked = 0;
  std::size_t m_excluded = 0;
  std::map<std::string, std::size_t> m_skipped;
  std::map<std::string, std::size_t> m_notes;
  std::vector<Mismatch> m_mismatches;
};

} // namespace conformance
