// Conformance of mep's name canonicalizer with tests/conformance/data/precis (see its
// README.md): PRECIS derived properties, the UsernameCaseMapped profile and the string
// classes, and UTS #39 skeletons and restriction checks. One test case per data file.
//
// Design notes. Everything is checked through the functions the product uses:
// mep::username_case_mapped (and, for agreement, precis::enforce_username_case_mapped),
// precis::check_class, precis::derived_property, mep::confusable_skeleton,
// mep::uts39_checks (the call behind uts39_check) and mep::restriction_level. A record's
// expectation is its `output`/`error`, or `u15_output`/`u15_error` where `u15_agrees` is
// false; `assertion` limits what is compared (error_only / accept_only: the verdict;
// class_membership: the verdict; exact_output_or_error_kind: the output, or an error of
// x/text's kind). x/text's error kinds map onto ours as the README describes; the one
// documented divergence (x/text applies the Bidi Rule to every non-ASCII string, RFC 8265
// only to strings with R/AL/AN) is accepted by rule, counted and printed, not excluded.
// Every other difference fails unless tests/conformance/exclusions.json names it, and an
// entry there that matches nothing fails as stale.
#include "conformance_support.hpp"

#include "mep/canonical.hpp"
#include "mep/precis.hpp"

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <iostream>
#include <set>

namespace json = boost::json;
namespace precis = mep::precis;
using conformance::FileReport;
using conformance::Mismatch;
using conformance::show;

namespace {

// ---- running mep -----------------------------------------------------------------------

// A verdict in precis_i18n's vocabulary: the output, or the error name without
// "DISALLOWED/" and the offending code point of the checked string.
struct Outcome {
  bool accepted = false;
  std::string output;
  std::string error;
  std::optional<char32_t> codepoint;
  bool context_rule = false;

  std::optional<std::string> output_or_null() const {
    return accepted ? std::optional<std::string>(output) : std::nullopt;
  }
  std::optional<std::string> error_or_null() const {
    return accepted ? std::nullopt : std::optional<std::string>(error);
  }
};

Outcome rejected(const precis::Error& e) {
  return Outcome{false, {}, std::string(e.name), e.codepoint, e.is_context_rule()};
}

Outcome accepted(std::string out) { return Outcome{true, std::move(out), {}, std::nullopt, false}; }

// UsernameCaseMapped through the product's UTF-8 entry point; `agreement` receives a
// description when the precis layer called directly disagrees with it.
Outcome run_username_case_mapped(const std::string& in, std::string& agreement) {
  Outcome o;
  auto r = mep::username_case_mapped(in);
  if (r) {
    o = accepted(*r);
  } else {
    o.error = r.error().precis_error.empty() ? std::string(mep::to_string(r.error().reason)) : r.error().precis_error;
    o.codepoint = r.error().codepoint;
    o.context_rule = r.error().reason == mep::NameReason::context_rule;
  }
  auto u = conformance::decode(in);
  if (!u) {
    agreement = "input is not UTF-8";
    return o;
  }
  auto p = precis::enforce_username_case_mapped(*u);
  Outcome q = p ? accepted(conformance::encode(*p)) : rejected(p.error());
  if (q.accepted != o.accepted || q.output != o.output || q.error != o.error || q.codepoint != o.codepoint ||
      q.context_rule != o.context_rule)
    agreement = fmt::format("mep::username_case_mapped gives {} {}, precis::enforce_username_case_mapped {} {}",
                            show(o.output_or_null()), show(o.error_or_null()), show(q.output_or_null()),
                            show(q.error_or_null()));
  return o;
}

// The bare IdentifierClass: no mapping, no normalization, no Bidi Rule, and no emptiness
// rule either (RFC 8265's profiles forbid empty strings, the RFC 8264 string class does
// not): precis_i18n's golden.json accepts "" for IdentifierClass and rejects it for
// UsernameCaseMapped.
Outcome run_identifier_class(const std::string& in) {
  auto u = conformance::decode(in);
  if (!u) return Outcome{false, {}, "invalid-utf8", std::nullopt, false};
  if (auto e = precis::check_class(*u, precis::StringClass::identifier)) return rejected(*e);
  return accepted(in);
}

// The FreeformClass on NFC(input), as x/text's NewFreeform() normalizes.
Outcome run_freeform_class(const std::string& in) {
  auto u = conformance::decode(in);
  if (!u) return Outcome{false, {}, "invalid-utf8", std::nullopt, false};
  std::u32string n = precis::nfc(*u);
  if (n.empty()) return Outcome{false, {}, "empty", std::nullopt, false};
  if (auto e = precis::check_class(n, precis::StringClass::freeform)) return rejected(*e);
  return accepted(conformance::encode(n));
}

std::string strip_disallowed(const std::string& e) {
  constexpr std::string_view prefix = "DISALLOWED/";
  return e.rfind(prefix, 0) == 0 ? e.substr(prefix.size()) : e;
}

std::string cp_label(std::optional<char32_t> c) { return c ? mep::format_codepoint(*c) : ""; }

bool is_ascii(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

// ---- one PRECIS record --------------------------------------------------------------------

struct Record {
  const json::object& o;
  std::string key;
  std::size_t line;
  std::string input;
  FileReport& report;
  std::string context; ///< printed with each mismatch: the input's code points

  void mismatch(std::string field, std::string expected, std::string got, std::string codepoint = {}) {
    report.mismatch(
        Mismatch{key, line, std::move(codepoint), std::move(field), std::move(expected), std::move(got), context});
  }
  // Compares two shown values.
  void compare(const std::string& field, const std::string& expected, const std::string& got,
               const std::string& codepoint = {}) {
    if (expected != got) mismatch(field, expected, got, codepoint);
  }
};

// A verdict for mismatch lines: `true: <output>` or `false: <error>`.
std::string show_verdict(const std::optional<std::string>& out, const std::optional<std::string>& err) {
  return err ? "false: " + show(strip_disallowed(*err)) : "true: " + show(out);
}
std::string show_verdict(const Outcome& o) { return show_verdict(o.output_or_null(), o.error_or_null()); }

// Compares the verdicts (accepted or not); on a difference both results are shown.
void compare_verdict(Record& r, const std::string& field, const std::optional<std::string>& out,
                     const std::optional<std::string>& err, const Outcome& ours) {
  if (err.has_value() != !ours.accepted)
    r.mismatch(field, show_verdict(out, err), show_verdict(ours), cp_label(ours.codepoint));
}

// Compares an exact precis_i18n result ({output, error}) with ours.
void compare_exact(Record& r, const std::string& prefix, const std::optional<std::string>& out,
                   const std::optional<std::string>& err, const Outcome& ours) {
  compare_verdict(r, prefix + "accepted", out, err, ours);
  if (err.has_value() != !ours.accepted) return;
  if (ours.accepted)
    r.compare(prefix + "output", show(out), show(ours.output));
  else
    r.compare(prefix + "error", show(strip_disallowed(*err)), show(ours.error), cp_label(ours.codepoint));
}

// x/text's error kinds (Go error variables) against ours.
void compare_xtext_kind(Record& r, const std::string& kind, const Outcome& ours, const std::string& profile) {
  bool ok = false;
  if (kind == "errContext") {
    ok = ours.context_rule;
  } else if (kind == "errDisallowedRune") {
    ok = ours.codepoint.has_value() && !ours.context_rule;
  } else if (kind == "errEmptyString") {
    ok = ours.error == "empty";
  } else if (kind == "not_in_class") {
    ok = true; // class membership: the verdict was compared already
  } else if (kind == "bidirule.ErrInvalid") {
    ok = ours.error == "bidi_rule";
    if (!ok && profile == "UsernameCaseMapped") {
      // x/text applies RFC 5893 to every non-ASCII string, RFC 8265 only to strings with
      // R/AL/AN code points (README "Disagreements"). Then the class error precis_i18n
      // reports for the same input is the expectation.
      auto u = conformance::decode(r.input);
      auto pi = r.o.if_contains("precis_i18n_usernamecasemapped");
      if (u && pi && pi->is_object() && !precis::has_rtl(precis::map_username_case_mapped(*u))) {
        auto perr = conformance::string_or_null(pi->as_object(), "error");
        ok = perr && strip_disallowed(*perr) == ours.error;
        if (ok)
          r.report.note("x/text bidirule.ErrInvalid on a string without R/AL/AN; RFC 8265 "
                        "applies no Bidi Rule, precis_i18n's class error matches ours");
      }
    }
  } else {
    r.mismatch("error-kind", show(kind), "(unknown x/text error kind)");
    return;
  }
  if (!ok) r.mismatch("error-kind", show(kind), show(ours.error), cp_label(ours.codepoint));
}

std::string level_name(mep::RestrictionLevel l) { return std::string(mep::to_string(l)); }

bool at_most_highly(mep::RestrictionLevel l) { return l <= mep::RestrictionLevel::highly_restrictive; }

// UTS #39 fields, computed on the expected output.
void compare_uts39(Record& r, const std::string& output) {
  if (!r.o.contains("skeleton") || r.o.at("skeleton").is_null()) return;
  r.compare("skeleton", show(conformance::string_or_null(r.o, "skeleton")), show(mep::confusable_skeleton(output)));
  auto c = mep::uts39_checks(output);
  if (!c) {
    r.mismatch("uts39", "checks run", "ICU rejected the text");
    return;
  }
  auto opt_string = [&](std::string_view k) { return show(conformance::string_or_null(r.o, k)); };
  if (r.o.contains("restriction_level"))
    r.compare("restriction_level", opt_string("restriction_level"), show(level_name(c->level)));
  if (r.o.contains("highly_restrictive"))
    r.compare("highly_restrictive", show(conformance::bool_field(r.o, "highly_restrictive")),
              show(c->highly_restrictive));
  if (r.o.contains("restriction_level_idset") || r.o.contains("highly_restrictive_idset")) {
    auto l = mep::restriction_level(output, mep::AllowedSet::identifier);
    if (r.o.contains("restriction_level_idset"))
      r.compare("restriction_level_idset", opt_string("restriction_level_idset"), show(level_name(l)));
    if (r.o.contains("highly_restrictive_idset"))
      r.compare("highly_restrictive_idset", show(conformance::bool_field(r.o, "highly_restrictive_idset")),
                show(at_most_highly(l)));
  }
  if (r.o.contains("mixed_numbers"))
    r.compare("mixed_numbers", show(conformance::bool_field(r.o, "mixed_numbers")), show(c->mixed_numbers));
  if (r.o.contains("invisible"))
    r.compare("invisible", show(conformance::bool_field(r.o, "invisible")), show(c->invisible));
}

// The agent pipeline (mep::canonicalize) runs the same PRECIS steps with its own code
// (and an ASCII fast path). Where the input has no White_Space or Zs code point (trimming
// and space removal are identities), the data constrains it: canonicalize() may reject
// more (agent-name policy, length, UTS #39) but never accept what UsernameCaseMapped
// rejects, must produce the profile's output and the record's skeleton when it accepts,
// and must name the record's error or failing UTS #39 check when it rejects for PRECIS or
// UTS #39 reasons.
void check_agent_pipeline(Record& r, const std::string& assertion, const std::optional<std::string>& out,
                          const std::optional<std::string>& err) {
  auto u = conformance::decode(r.input);
  if (!u || r.input.empty()) return;
  for (char32_t c : *u)
    if (u_isUWhiteSpace(static_cast<UChar32>(c)) || u_charType(static_cast<UChar32>(c)) == U_SPACE_SEPARATOR) {
      r.report.note("agent pipeline not compared: input holds White_Space or Zs");
      return;
    }
  auto c = mep::canonicalize(r.input);
  const bool exact = assertion == "exact" || assertion == "exact_output_or_error_kind";
  r.report.note(c ? "agent pipeline compared: accepted" : "agent pipeline compared: rejected");
  if (c) {
    if (err) {
      r.mismatch("canonicalize.accepted", show_verdict(out, err), "true: " + show(c->canonical_name));
      return;
    }
    if (exact) r.compare("canonicalize.canonical_name", show(out), show(c->canonical_name));
    if (r.o.contains("skeleton") && !r.o.at("skeleton").is_null()) {
      r.compare("canonicalize.skeleton", show(conformance::string_or_null(r.o, "skeleton")), show(c->skeleton));
      r.compare("canonicalize.highly_restrictive", show(conformance::bool_field(r.o, "highly_restrictive")), "true");
      r.compare("canonicalize.mixed_numbers", show(conformance::bool_field(r.o, "mixed_numbers")), "false");
      r.compare("canonicalize.invisible", show(conformance::bool_field(r.o, "invisible")), "false");
    }
    return;
  }
  const mep::NameError& e = c.error();
  const bool has_uts39 = !err && r.o.contains("skeleton") && !r.o.at("skeleton").is_null();
  if (e.reason == mep::NameReason::mixed_script && has_uts39)
    r.compare("canonicalize.mixed-script", show(conformance::bool_field(r.o, "highly_restrictive")), "false");
  if (e.reason == mep::NameReason::mixed_numbers && has_uts39)
    r.compare("canonicalize.mixed-numbers", show(conformance::bool_field(r.o, "mixed_numbers")), "true");
  if (e.reason == mep::NameReason::invisible_character && has_uts39)
    r.compare("canonicalize.invisible-character", show(conformance::bool_field(r.o, "invisible")), "true");
  if (!e.precis_error.empty() && assertion == "exact")
    r.compare("canonicalize.precis_error", show(err ? std::optional(strip_disallowed(*err)) : std::nullopt),
              show(e.precis_error), cp_label(e.codepoint));
}

Outcome run_profile(Record& r, const std::string& profile) {
  if (profile == "UsernameCaseMapped") {
    std::string agreement;
    Outcome o = run_username_case_mapped(r.input, agreement);
    if (!agreement.empty()) r.mismatch("api-agreement", "the same result", agreement);
    return o;
  }
  if (profile == "IdentifierClass") return run_identifier_class(r.input);
  if (profile == "FreeformClass") return run_freeform_class(r.input);
  throw std::runtime_error("unknown profile " + profile);
}

void check_precis_record(Record& r) {
  const std::string profile = conformance::string_field(r.o, "profile");
  const std::string assertion = r.o.contains("assertion") ? conformance::string_field(r.o, "assertion") : "exact";

  // Expectation, with the Unicode 15.0 values where the oracle's 14.0 data differ.
  std::optional<std::string> out = conformance::string_or_null(r.o, "output");
  std::optional<std::string> err = conformance::string_or_null(r.o, "error");
  // error_cp: absent (not compared), or the expected code point / null.
  std::optional<std::optional<std::string>> error_cp;
  if (r.o.contains("error_cp")) error_cp = conformance::string_or_null(r.o, "error_cp");
  if (r.o.contains("u15_agrees") && !conformance::bool_field(r.o, "u15_agrees")) {
    out = conformance::string_or_null(r.o, "u15_output");
    err = conformance::string_or_null(r.o, "u15_error");
    r.report.note("expectation taken from u15_output/u15_error (u15_agrees false)");
    // There is no u15 error_cp; whole-string errors have none, others are not compared.
    static const std::set<std::string> k_whole = {"DISALLOWED/bidi_rule", "DISALLOWED/empty",
                                                  "DISALLOWED/not_idempotent"};
    if (!err || k_whole.count(*err))
      error_cp = std::optional<std::string>();
    else
      error_cp.reset();
  }
  const bool expect_accept = !err.has_value();

  Outcome ours = run_profile(r, profile);

  compare_verdict(r, "accepted", out, err, ours);
  if (expect_accept == ours.accepted) {
    if (assertion == "exact") {
      compare_exact(r, "", out, err, ours);
      if (!ours.accepted && error_cp)
        r.compare("error_cp", show(*error_cp),
                  show(ours.codepoint ? std::optional(cp_label(ours.codepoint)) : std::nullopt));
    } else if (assertion == "exact_output_or_error_kind") {
      if (ours.accepted)
        r.compare("output", show(out), show(ours.output));
      else
        compare_xtext_kind(r, *err, ours, profile);
    } else if (assertion == "error_only" || assertion == "accept_only" || assertion == "class_membership") {
      // Only the verdict is asserted; the other value is precis_i18n's (for
      // class_membership precis_i18n's result is compared below). Tally differences.
      if (assertion != "class_membership" &&
          (ours.accepted ? (out && *out != ours.output) : (err && strip_disallowed(*err) != ours.error)))
        r.report.note(fmt::format("{}: verdict agrees, precis_i18n's unasserted {} differs", assertion,
                                  ours.accepted ? "output" : "error name"));
      if (assertion == "class_membership" && !ours.accepted) compare_xtext_kind(r, *err, ours, profile);
    } else {
      r.mismatch("assertion", "a known assertion", show(assertion));
    }
  }

  // x/text records also carry precis_i18n's results for the same input.
  static constexpr std::pair<std::string_view, std::string_view> k_oracle_fields[] = {
      {"precis_i18n_usernamecasemapped", "UsernameCaseMapped"},
      {"precis_i18n_identifierclass", "IdentifierClass"},
      {"precis_i18n_freeformclass", "FreeformClass"},
  };
  for (auto [field, p] : k_oracle_fields) {
    const auto* v = r.o.if_contains(field);
    if (!v || !v->is_object()) continue;
    Outcome o = p == profile ? ours : run_profile(r, std::string(p));
    compare_exact(r, std::string(field) + ".", conformance::string_or_null(v->as_object(), "output"),
                  conformance::string_or_null(v->as_object(), "error"), o);
  }

  // The differential corpus marks accepted LTR outputs that fail RFC 5893 (accepted
  // because RFC 8265 applies the Bidi Rule only with R/AL/AN): our bidi_rule must agree.
  if (ours.accepted && r.o.contains("strict_bidi_would_reject")) {
    auto u = conformance::decode(ours.output);
    bool strict = u && !is_ascii(ours.output) && !precis::has_rtl(*u) && !precis::bidi_rule(*u);
    r.compare("strict_bidi_would_reject", show(conformance::bool_field(r.o, "strict_bidi_would_reject")), show(strict));
  }

  if (expect_accept && out) compare_uts39(r, *out);
  if (profile == "UsernameCaseMapped") check_agent_pipeline(r, assertion, out, err);
}

std::string record_key(const json::object& o, const std::string& input) {
  if (o.contains("id")) return conformance::string_field(o, "id");
  std::string lead =
      o.contains("kind") ? conformance::string_field(o, "kind") : conformance::string_field(o, "profile");
  return lead + " " + conformance::code_points(input);
}

// Reads a JSON-lines file and calls `check(record)` for each record that can be checked.
template <class Check>
std::size_t for_each_record(const std::string& file, Check check, bool uses_input = true) {
  FileReport report(file);
  const std::string text = conformance::read_file(conformance::data_dir() / file);
  for (auto [number, line] : conformance::split_lines(text)) {
    if (line.empty()) continue;
    json::error_code ec;
    json::value v = json::parse(line, ec);
    if (ec) {
      if (conformance::has_lone_surrogate_escape(line)) {
        report.skipped("lone surrogate in input (JSON \\u escape), not representable in UTF-8");
        continue;
      }
      report.mismatch(Mismatch{fmt::format("line {}", number), number, {}, "json", "valid JSON", ec.message(), {}});
      continue;
    }
    if (!v.is_object()) {
      report.mismatch(Mismatch{fmt::format("line {}", number), number, {}, "json", "an object", "other", {}});
      continue;
    }
    const json::object& o = v.as_object();
    std::string key = fmt::format("line {}", number);
    try {
      std::string input = uses_input && o.contains("input") ? conformance::string_field(o, "input") : "";
      key = record_key(o, input);
      if (o.contains("min_unicode_version")) {
        const json::value& mv = o.at("min_unicode_version");
        double need = mv.is_string() ? std::stod(std::string(mv.as_string())) : mv.to_number<double>();
        if (need > std::stod(mep::unicode_version())) {
          report.skipped("needs a newer Unicode than ICU's " + mep::unicode_version());
          continue;
        }
      }
      std::string all_text = input;
      for (std::string_view k : {"a", "b"})
        if (o.contains(k) && o.at(k).is_string()) all_text += std::string(o.at(k).as_string());
      if (auto c = conformance::new_in_unicode_15().first_in(all_text)) {
        report.skipped("holds a code point new in Unicode 15.0 (unicode_version_exclusions.json), e.g. " +
                       mep::format_codepoint(*c));
        continue;
      }
      Record r{o, key, number, input, report, "input " + conformance::code_points(input)};
      check(r);
      report.checked();
    } catch (const std::exception& e) {
      report.mismatch(Mismatch{key, number, {}, "record", "a well-formed record", e.what(), {}});
    }
  }
  return report.finish();
}

std::size_t check_precis_file(const std::string& file) {
  return for_each_record(file, [](Record& r) { check_precis_record(r); });
}

// ---- the derived-property tables ------------------------------------------------------------

struct TableMismatch {
  char32_t first, last;
  std::string expected, got;
};

// Collapses consecutive code points with the same difference into one mismatch.
void add_table_mismatch(std::vector<TableMismatch>& v, char32_t cp, std::string expected, std::string got) {
  if (!v.empty() && v.back().last + 1 == cp && v.back().expected == expected && v.back().got == got) {
    v.back().last = cp;
    return;
  }
  v.push_back({cp, cp, std::move(expected), std::move(got)});
}

void report_table_mismatches(FileReport& report, const std::vector<TableMismatch>& v, const std::string& field) {
  for (const auto& m : v) {
    std::string label = mep::format_codepoint(m.first);
    if (m.last != m.first) label += ".." + mep::format_codepoint(m.last);
    report.mismatch(Mismatch{label, 0, label, field, m.expected, m.got, {}});
  }
}

std::string ours_derived(char32_t cp) {
  auto d = precis::derived_property(cp);
  return std::string(precis::property_name(d.property)) + "/" + std::string(d.reason);
}

} // namespace

TEST_CASE("precis_i18n_derived-props-15.0.txt", "[conformance][precis]") {
  const std::string file = "precis_i18n_derived-props-15.0.txt";
  FileReport report(file);
  const std::string text = conformance::read_file(conformance::data_dir() / file);
  std::vector<TableMismatch> diffs;
  char32_t next = 0;
  for (auto [number, line] : conformance::split_lines(text)) {
    if (line.empty()) continue;
    // FIRST-LAST PROPERTY/reason
    auto dash = line.find('-');
    auto space = line.find(' ');
    REQUIRE(dash != std::string_view::npos);
    REQUIRE(space != std::string_view::npos);
    char32_t first = conformance::parse_hex(line.substr(0, dash));
    char32_t last = conformance::parse_hex(line.substr(dash + 1, space - dash - 1));
    std::string expected(line.substr(space + 1));
    INFO("line " << number);
    REQUIRE(first == next); // the runs cover U+0000..U+10FFFF without gaps
    REQUIRE(last >= first);
    for (char32_t cp = first; cp <= last; ++cp) {
      std::string got = ours_derived(cp);
      if (got != expected) add_table_mismatch(diffs, cp, expected, got);
    }
    report.checked(last - first + 1);
    next = last + 1;
  }
  CHECK(next == 0x110000);
  report_table_mismatches(report, diffs, "derived_property");
  CHECK(report.finish() == 0);
}

TEST_CASE("iana-precis-tables-6.3.0.csv", "[conformance][precis]") {
  const std::string file = "iana-precis-tables-6.3.0.csv";
  FileReport report(file);
  const std::string text = conformance::read_file(conformance::data_dir() / file);
  std::vector<TableMismatch> diffs;
  char32_t next = 0;
  for (auto [number, line] : conformance::split_lines(text)) {
    if (line.empty() || line.rfind("Codepoint,", 0) == 0) continue;
    // Codepoint,Property,Description (the description may hold commas)
    auto c1 = line.find(',');
    auto c2 = line.find(',', c1 + 1);
    INFO("line " << number);
    REQUIRE(c2 != std::string_view::npos);
    std::string_view cps = line.substr(0, c1);
    std::string prop(line.substr(c1 + 1, c2 - c1 - 1));
    auto dash = cps.find('-');
    char32_t first = conformance::parse_hex(cps.substr(0, dash));
    char32_t last = dash == std::string_view::npos ? first : conformance::parse_hex(cps.substr(dash + 1));
    REQUIRE(first == next);
    next = last + 1;
    if (prop == "ID_DIS or FREE_PVAL") prop = "FREE_PVAL";
    static const std::set<std::string> k_props = {"PVALID",     "FREE_PVAL", "DISALLOWED",
                                                  "UNASSIGNED", "CONTEXTJ",  "CONTEXTO"};
    REQUIRE(k_props.count(prop) == 1);
    if (prop == "UNASSIGNED") {
      report.skipped("code points UNASSIGNED in Unicode 6.3", last - first + 1);
      continue;
    }
    for (char32_t cp = first; cp <= last; ++cp) {
      std::string got(precis::property_name(precis::derived_property(cp).property));
      if (got != prop) add_table_mismatch(diffs, cp, prop, got);
    }
    report.checked(last - first + 1);
  }
  CHECK(next == 0x110000);
  report_table_mismatches(report, diffs, "property");
  CHECK(report.finish() == 0);
}

TEST_CASE("unicode_version_exclusions.json", "[conformance][precis]") {
  // The table lists the code points new in Unicode 15.0; ICU 72 must have them assigned
  // (otherwise mep does not run on the Unicode version the data was checked against).
  const std::string file = "unicode_version_exclusions.json";
  FileReport report(file);
  auto doc = json::parse(conformance::read_file(conformance::data_dir() / file));
  const auto& o = doc.as_object();
  report.checked();
  if (conformance::string_field(o, "icu_unicode") != mep::unicode_version())
    report.mismatch(Mismatch{"icu_unicode",
                             0,
                             {},
                             "unicode_version",
                             show(conformance::string_field(o, "icu_unicode")),
                             show(mep::unicode_version()),
                             {}});
  const auto& ranges = conformance::new_in_unicode_15();
  std::vector<TableMismatch> diffs;
  std::size_t n = 0;
  for (char32_t cp = 0; cp < 0x110000; ++cp) {
    if (!ranges.contains(cp)) continue;
    ++n;
    auto d = precis::derived_property(cp);
    if (d.property == precis::Property::unassigned) add_table_mismatch(diffs, cp, "assigned", "UNASSIGNED");
  }
  CHECK(n == static_cast<std::size_t>(o.at("new_in_unicode_15_count").as_int64()));
  report.checked(n);
  report_table_mismatches(report, diffs, "assigned_in_unicode_15");
  // The lists of code points assigned in both versions whose data differ are empty; a
  // non-empty one needs the records that use them looked at.
  for (const char* group : {"assigned_in_both_but_different", "precis_i18n_internal_tables_vs_icu"})
    for (const auto& kv : o.at(group).as_object())
      if (!kv.value().as_array().empty())
        report.mismatch(Mismatch{
            std::string(group) + "." + std::string(kv.key()), 0, {}, "entries", "[]", json::serialize(kv.value()), {}});
  CHECK(report.finish() == 0);
}

TEST_CASE("vectors_precis_i18n_golden.jsonl", "[conformance][precis]") {
  CHECK(check_precis_file("vectors_precis_i18n_golden.jsonl") == 0);
}

TEST_CASE("vectors_precis_i18n_unittests.jsonl", "[conformance][precis]") {
  CHECK(check_precis_file("vectors_precis_i18n_unittests.jsonl") == 0);
}

TEST_CASE("vectors_xtext.jsonl", "[conformance][precis]") { CHECK(check_precis_file("vectors_xtext.jsonl") == 0); }

TEST_CASE("differential_public.jsonl", "[conformance][precis]") {
  CHECK(check_precis_file("differential_public.jsonl") == 0);
}

TEST_CASE("vectors_icu_spoof.jsonl", "[conformance][uts39]") {
  auto check = [](Record& r) {
    const std::string kind = conformance::string_field(r.o, "kind");
    if (kind == "skeleton") {
      r.compare("skeleton", show(conformance::string_field(r.o, "expected_skeleton")),
                show(mep::confusable_skeleton(r.input)));
    } else if (kind == "confusable_pair") {
      const std::string a = conformance::string_field(r.o, "a");
      const std::string b = conformance::string_field(r.o, "b");
      r.key = "confusable_pair " + conformance::code_points(a) + " / " + conformance::code_points(b);
      r.context.clear();
      const std::string sa = mep::confusable_skeleton(a), sb = mep::confusable_skeleton(b);
      r.compare("skeleton_a", show(conformance::string_field(r.o, "skeleton_a")), show(sa));
      r.compare("skeleton_b", show(conformance::string_field(r.o, "skeleton_b")), show(sb));
      r.compare("expected_confusable", show(conformance::bool_field(r.o, "expected_confusable")), show(sa == sb));
    } else if (kind == "restriction_level") {
      const std::string allowed = conformance::string_field(r.o, "allowed_set");
      const std::string expected = conformance::string_field(r.o, "expected_level");
      auto c = mep::uts39_checks(r.input);
      REQUIRE(c);
      r.compare("icu72_level_default_checker", show(conformance::string_field(r.o, "icu72_level_default_checker")),
                show(level_name(c->level)));
      if (allowed == "uspoof_getRecommendedSet() + U+303C") {
        auto l = mep::restriction_level(r.input, mep::AllowedSet::recommended, U"\u303C");
        r.compare("expected_level", show(expected), show(level_name(l)));
      } else if (allowed == "default (all code points)") {
        // ICU's testBug13328 asserts only that the HIGHLY_RESTRICTIVE check fails.
        if (expected == "worse than HIGHLY_RESTRICTIVE (check fails)")
          r.compare("expected_level", "HIGHLY_RESTRICTIVE check fails",
                    c->highly_restrictive ? "passes at " + level_name(c->level) : "HIGHLY_RESTRICTIVE check fails");
        else
          r.compare("expected_level", show(expected), show(level_name(c->level)));
        r.compare("icu72_level", show(conformance::string_field(r.o, "icu72_level")), show(level_name(c->level)));
      } else {
        r.mismatch("allowed_set", "a known allowed set", show(allowed));
      }
    } else if (kind == "invisible" || kind == "mixed_numbers") {
      auto c = mep::uts39_checks(r.input);
      REQUIRE(c);
      r.compare("expected_fails", show(conformance::bool_field(r.o, "expected_fails")),
                show(kind == "invisible" ? c->invisible : c->mixed_numbers));
    } else {
      r.mismatch("kind", "a known kind", show(kind));
    }
  };
  CHECK(for_each_record("vectors_icu_spoof.jsonl", check) == 0);
}

TEST_CASE("confusable_pairs.jsonl", "[conformance][uts39]") {
  auto check = [](Record& r) {
    const std::string a = conformance::string_field(r.o, "a");
    const std::string b = conformance::string_field(r.o, "b");
    r.context = "a " + conformance::code_points(a) + ", b " + conformance::code_points(b);
    const std::string sa = mep::confusable_skeleton(a), sb = mep::confusable_skeleton(b);
    r.compare("skeleton_a", show(conformance::string_field(r.o, "skeleton_a")), show(sa));
    r.compare("skeleton_b", show(conformance::string_field(r.o, "skeleton_b")), show(sb));
    r.compare("expected_skeleton_equal", show(conformance::bool_field(r.o, "expected_skeleton_equal")), show(sa == sb));
    // The comparison a canonicalizer makes: skeletons of the UsernameCaseMapped outputs.
    std::optional<std::string> skel[2];
    const std::string* sides[2] = {&a, &b};
    for (int i = 0; i < 2; ++i) {
      const std::string side = i == 0 ? "a" : "b";
      std::string agreement;
      Outcome o = run_username_case_mapped(*sides[i], agreement);
      if (!agreement.empty()) r.mismatch("api-agreement_" + side, "the same result", agreement);
      compare_exact(r, "precis_" + side + ".", conformance::string_or_null(r.o, "precis_" + side),
                    conformance::string_or_null(r.o, "precis_" + side + "_error"), o);
      if (o.accepted) skel[i] = mep::confusable_skeleton(o.output);
      r.compare("skeleton_precis_" + side, show(conformance::string_or_null(r.o, "skeleton_precis_" + side)),
                show(skel[i]));
    }
    r.compare("precis_skeleton_equal", show(conformance::bool_field(r.o, "precis_skeleton_equal")),
              show(skel[0] && skel[1] && *skel[0] == *skel[1]));
  };
  CHECK(for_each_record("confusable_pairs.jsonl", check, false) == 0);
}

TEST_CASE("exclusions.json", "[conformance]") {
  // The list is well-formed; whether each entry still matches is checked by the test of
  // the entry's data file.
  auto& ex = conformance::exclusions();
  for (const auto& e : ex.errors()) std::cout << "BAD EXCLUSION " << e << '\n';
  std::cout << "exclusions.json: " << ex.entries().size() << " entries\n";
  CHECK(ex.errors().empty());
}

TEST_CASE("every_data_file_is_checked", "[conformance]") {
  // A new file in the data directory must get a test case here.
  const auto& known = conformance::known_data_files();
  std::vector<std::string> unknown;
  for (const auto& entry : std::filesystem::directory_iterator(conformance::data_dir())) {
    std::string name = entry.path().filename().string();
    if (name == "README.md" || name == "LICENSES" || name == "tools") continue;
    if (std::find(known.begin(), known.end(), name) == known.end()) unknown.push_back(name);
  }
  for (const auto& name : known) {
    INFO(name);
    CHECK(std::filesystem::exists(conformance::data_dir() / name));
  }
  for (const auto& name : unknown) std::cout << "UNCHECKED DATA FILE " << name << '\n';
  CHECK(unknown.empty());
}
