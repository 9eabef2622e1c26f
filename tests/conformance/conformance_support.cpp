// Support for the PRECIS / UTS #39 conformance test.
//
// Design notes. The data (tests/conformance/data, a byte-for-byte copy) is read in place: each JSON line is
// parsed by Boost.JSON, lines are split on '\n' only. Mismatches are collected per data
// file and printed together at the end with the file's counts, in a form that can be
// pasted into exclusions.json (record, field, expected, got). Values are printed as code
// points unless they are printable ASCII, so invisible and right-to-left characters
// cannot hide a difference.
#include "conformance_support.hpp"

#include "mep/canonical.hpp"

#include <fmt/format.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#ifndef MEP_CONFORMANCE_DIR
#error "MEP_CONFORMANCE_DIR must be defined"
#endif
#ifndef MEP_CONFORMANCE_EXCLUSIONS
#error "MEP_CONFORMANCE_EXCLUSIONS must be defined"
#endif

namespace conformance {
namespace {

bool is_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

unsigned hex4(std::string_view s) {
  return static_cast<unsigned>(std::stoul(std::string(s.substr(0, 4)), nullptr, 16));
}

bool valid_codepoint_label(std::string_view s) {
  // U+XXXX or U+XXXX..U+YYYY
  auto one = [](std::string_view t) {
    if (t.size() < 6 || t.size() > 8 || t.substr(0, 2) != "U+") return false;
    return std::all_of(t.begin() + 2, t.end(), [](char c) { return is_hex(c) && !(c >= 'a' && c <= 'f'); });
  };
  auto dots = s.find("..");
  if (dots == std::string_view::npos) return one(s);
  return one(s.substr(0, dots)) && one(s.substr(dots + 2));
}

} // namespace

char32_t parse_hex(std::string_view s) {
  std::size_t used = 0;
  unsigned long v = std::stoul(std::string(s), &used, 16);
  if (used != s.size() || v > 0x10FFFF) throw std::runtime_error("bad code point \"" + std::string(s) + "\"");
  return static_cast<char32_t>(v);
}

std::filesystem::path data_dir() { return std::filesystem::path(MEP_CONFORMANCE_DIR) / "precis"; }

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::pair<std::size_t, std::string_view>> split_lines(std::string_view text) {
  std::vector<std::pair<std::size_t, std::string_view>> out;
  std::size_t number = 0;
  while (!text.empty()) {
    ++number;
    auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    out.emplace_back(number, line);
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return out;
}

bool has_lone_surrogate_escape(std::string_view s) {
  for (std::size_t i = 0; i + 6 <= s.size(); ++i) {
    if (s[i] != '\\') continue;
    // An escaped backslash is not the start of an escape.
    if (s[i + 1] == '\\') {
      ++i;
      continue;
    }
    if (s[i + 1] != 'u' || !std::all_of(s.begin() + static_cast<std::ptrdiff_t>(i) + 2,
                                        s.begin() + static_cast<std::ptrdiff_t>(i) + 6, is_hex))
      continue;
    unsigned u = hex4(s.substr(i + 2));
    if (u >= 0xDC00 && u <= 0xDFFF) return true; // trail without lead (a pair skips it below)
    if (u >= 0xD800 && u <= 0xDBFF) {
      bool paired = i + 12 <= s.size() && s[i + 6] == '\\' && s[i + 7] == 'u' &&
                    std::all_of(s.begin() + static_cast<std::ptrdiff_t>(i) + 8,
                                s.begin() + static_cast<std::ptrdiff_t>(i) + 12, is_hex) &&
                    hex4(s.substr(i + 8)) >= 0xDC00 && hex4(s.substr(i + 8)) <= 0xDFFF;
      if (!paired) return true;
      i += 11;
    }
  }
  return false;
}

std::optional<std::u32string> decode(std::string_view s) {
  std::u32string out;
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  int32_t i = 0;
  const auto n = static_cast<int32_t>(s.size());
  while (i < n) {
    UChar32 c;
    U8_NEXT(p, i, n, c);
    if (c < 0) return std::nullopt;
    out.push_back(static_cast<char32_t>(c));
  }
  return out;
}

std::string encode(std::u32string_view s) {
  std::string out;
  for (char32_t c : s) {
    char buf[4];
    int32_t n = 0;
    UBool err = false;
    U8_APPEND(reinterpret_cast<uint8_t*>(buf), n, 4, static_cast<UChar32>(c), err);
    if (err) throw std::runtime_error("cannot encode " + mep::format_codepoint(c));
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

std::string code_points(std::string_view utf8) {
  if (utf8.empty()) return "(empty)";
  auto u = decode(utf8);
  if (!u) return "(invalid UTF-8)";
  std::string out;
  for (char32_t c : *u) {
    if (!out.empty()) out += ' ';
    out += mep::format_codepoint(c);
  }
  return out;
}

std::string show(const std::optional<std::string>& v) {
  if (!v) return "null";
  bool printable = std::all_of(v->begin(), v->end(), [](char c) { return c >= 0x20 && c < 0x7F; });
  if (printable) return "\"" + *v + "\"";
  return code_points(*v);
}

std::string show(bool b) { return b ? "true" : "false"; }

bool CodePointRanges::contains(char32_t cp) const {
  return std::any_of(m_ranges.begin(), m_ranges.end(), [cp](const auto& r) { return cp >= r.first && cp <= r.second; });
}

std::optional<char32_t> CodePointRanges::first_in(std::string_view utf8) const {
  auto u = decode(utf8);
  if (!u) return std::nullopt;
  for (char32_t c : *u)
    if (contains(c)) return c;
  return std::nullopt;
}

std::size_t CodePointRanges::size() const {
  std::size_t n = 0;
  for (const auto& r : m_ranges) n += r.second - r.first + 1;
  return n;
}

const CodePointRanges& new_in_unicode_15() {
  static const CodePointRanges ranges = [] {
    CodePointRanges out;
    auto v = boost::json::parse(read_file(data_dir() / "unicode_version_exclusions.json"));
    for (const auto& r : at(v.as_object(), "exclude_ranges").as_array()) {
      std::string_view s = r.as_string();
      auto dots = s.find("..");
      if (dots == std::string_view::npos) {
        char32_t c = parse_hex(s);
        out.add(c, c);
      } else {
        out.add(parse_hex(s.substr(0, dots)), parse_hex(s.substr(dots + 2)));
      }
    }
    return out;
  }();
  return ranges;
}

const boost::json::value& at(const boost::json::object& o, std::string_view key) {
  auto it = o.find(key);
  if (it == o.end()) throw std::runtime_error(fmt::format("missing field \"{}\"", key));
  return it->value();
}

std::optional<std::string> string_or_null(const boost::json::object& o, std::string_view key) {
  const auto& v = at(o, key);
  if (v.is_null()) return std::nullopt;
  if (!v.is_string()) throw std::runtime_error(fmt::format("field \"{}\" is not a string", key));
  return std::string(v.as_string());
}

std::string string_field(const boost::json::object& o, std::string_view key) {
  auto s = string_or_null(o, key);
  if (!s) throw std::runtime_error(fmt::format("field \"{}\" is null", key));
  return *s;
}

bool bool_field(const boost::json::object& o, std::string_view key) {
  const auto& v = at(o, key);
  if (!v.is_bool()) throw std::runtime_error(fmt::format("field \"{}\" is not a boolean", key));
  return v.as_bool();
}

const std::vector<std::string>& known_data_files() {
  static const std::vector<std::string> files = {
      "precis_i18n_derived-props-15.0.txt",
      "iana-precis-tables-6.3.0.csv",
      "vectors_precis_i18n_golden.jsonl",
      "vectors_precis_i18n_unittests.jsonl",
      "vectors_xtext.jsonl",
      "differential_public.jsonl",
      "vectors_icu_spoof.jsonl",
      "confusable_pairs.jsonl",
      "unicode_version_exclusions.json",
  };
  return files;
}

Exclusions::Exclusions(const std::filesystem::path& p) {
  boost::json::value doc;
  try {
    doc = boost::json::parse(read_file(p));
  } catch (const std::exception& e) {
    m_errors.push_back(fmt::format("{}: {}", p.string(), e.what()));
    return;
  }
  const auto* list = doc.is_object() ? doc.as_object().if_contains("exclusions") : nullptr;
  if (!list || !list->is_array()) {
    m_errors.push_back(p.string() + ": expected an object with an \"exclusions\" array");
    return;
  }
  const auto& known = known_data_files();
  std::size_t n = 0;
  for (const auto& v : list->as_array()) {
    ++n;
    try {
      if (!v.is_object()) throw std::runtime_error("not an object");
      const auto& o = v.as_object();
      Entry e{string_field(o, "file"),      string_field(o, "record"),
              string_field(o, "codepoint"), string_field(o, "field"),
              string_field(o, "expected"),  string_field(o, "got"),
              string_field(o, "reason"),    0};
      if (std::find(known.begin(), known.end(), e.file) == known.end())
        throw std::runtime_error("unknown data file \"" + e.file + "\"");
      if (!valid_codepoint_label(e.codepoint))
        throw std::runtime_error("codepoint must be U+XXXX or U+XXXX..U+YYYY: \"" + e.codepoint + "\"");
      if (e.reason.size() < 20) throw std::runtime_error("reason must say which Unicode-version difference causes it");
      if (e.record.empty() || e.field.empty()) throw std::runtime_error("empty record or field");
      m_entries.push_back(std::move(e));
    } catch (const std::exception& ex) {
      m_errors.push_back(fmt::format("{}: entry {}: {}", p.string(), n, ex.what()));
    }
  }
}

bool Exclusions::excludes(std::string_view file, const Mismatch& m) {
  for (auto& e : m_entries) {
    if (e.file == file && e.record == m.record && e.field == m.field && e.expected == m.expected && e.got == m.got) {
      ++e.matched;
      return true;
    }
  }
  return false;
}

std::vector<const Exclusions::Entry*> Exclusions::unused(std::string_view file) const {
  std::vector<const Entry*> out;
  for (const auto& e : m_entries)
    if (e.file == file && e.matched == 0) out.push_back(&e);
  return out;
}

std::size_t Exclusions::count(std::string_view file) const {
  return static_cast<std::size_t>(
      std::count_if(m_entries.begin(), m_entries.end(), [&](const Entry& e) { return e.file == file; }));
}

Exclusions& exclusions() {
  static Exclusions ex{std::filesystem::path(MEP_CONFORMANCE_EXCLUSIONS)};
  return ex;
}

FileReport::FileReport(std::string file) : m_file(std::move(file)) {}

void FileReport::mismatch(Mismatch m) {
  if (exclusions().excludes(m_file, m)) {
    ++m_excluded;
    return;
  }
  m_mismatches.push_back(std::move(m));
}

std::size_t FileReport::finish() {
  auto& out = std::cout;
  auto stale = exclusions().unused(m_file);
  out << fmt::format("== {}\n", m_file);
  for (const auto& m : m_mismatches) {
    out << fmt::format("MISMATCH {}", m_file);
    if (m.line) out << ':' << m.line;
    out << fmt::format(" record {}", m.record);
    if (!m.codepoint.empty()) out << fmt::format(" at {}", m.codepoint);
    out << fmt::format(" field {}: expected {} got {}", m.field, m.expected, m.got);
    if (!m.context.empty()) out << fmt::format(" ({})", m.context);
    out << '\n';
  }
  for (const auto* e : stale)
    out << fmt::format("STALE EXCLUSION {} record {} at {} field {}: expected {} got {} matched "
                       "nothing; remove it from exclusions.json\n",
                       e->file, e->record, e->codepoint, e->field, e->expected, e->got);
  std::size_t skipped = 0;
  for (const auto& [why, n] : m_skipped) skipped += n;
  out << fmt::format("{}: checked {}, skipped {}, excluded {} (exclusion entries {}), "
                     "mismatches {}, stale exclusions {}\n",
                     m_file, m_checked, skipped, m_excluded, exclusions().count(m_file), m_mismatches.size(),
                     stale.size());
  for (const auto& [why, n] : m_skipped) out << fmt::format("  skipped {}: {}\n", n, why);
  for (const auto& [what, n] : m_notes) out << fmt::format("  note {}: {}\n", n, what);
  out.flush();
  return m_mismatches.size() + stale.size();
}

} // namespace conformance
