// Every example of SPEC §5, the reasons and positions of errors, and the ASCII fast path.
#include "mep/canonical.hpp"

#include <catch2/catch.hpp>

#include <random>

using mep::NameReason;

namespace {

std::string ok(std::string_view in) {
  auto r = mep::canonicalize(in);
  INFO("input: " << in << " error: " << (r ? std::string() : r.error().message()));
  REQUIRE(r);
  return r->canonical_name;
}

mep::NameError bad(std::string_view in) {
  auto r = mep::canonicalize(in);
  INFO("input: " << in);
  REQUIRE_FALSE(r);
  return r.error();
}

} // namespace

TEST_CASE("spec5_examples_valid", "[names]") {
  CHECK(ok("My Agent") == "myagent");
  CHECK(ok("\xEF\xBC\xAD\xEF\xBD\x99\xEF\xBC\xA1\xEF\xBD\x87\xEF\xBD\x85\xEF\xBD\x8E\xEF\xBD\x94") ==
        "myagent");                        // ＭｙＡｇｅｎｔ
  CHECK(ok("\xE2\x84\xA6") == "\xCF\x89"); // Ω OHM SIGN → ω
  CHECK(ok("ΟΔΟΣ") == "οδος");             // final sigma
  CHECK(ok("ΟΔΟΣ") == "\xCE\xBF\xCE\xB4\xCE\xBF\xCF\x82");
  CHECK(ok("e\xCC\x81") == "\xC3\xA9"); // NFC
  CHECK(ok("Straße") == "straße");
  CHECK(ok("STRASSE") == "strasse");
}

TEST_CASE("spec5_examples_invalid", "[names]") {
  auto e = bad("\xEF\xAC\x81le"); // ﬁle
  CHECK(e.reason == NameReason::disallowed_character);
  CHECK(e.codepoint == 0xFB01);
  CHECK(e.index == 0);

  e = bad("agent!");
  CHECK(e.reason == NameReason::disallowed_character);
  CHECK(e.codepoint == 0x21);
  CHECK(e.index == 5);
  CHECK(e.message() == "disallowed character U+0021 '!' at index 5");

  e = bad("bot\xF0\x9F\x98\x80");
  CHECK(e.reason == NameReason::disallowed_character);
  CHECK(e.codepoint == 0x1F600);
  CHECK(e.index == 3);

  e = bad("agent\xE2\x80\x8D");
  CHECK(e.reason == NameReason::context_rule);
  CHECK(e.codepoint == 0x200D);
  CHECK(e.index == 5);

  CHECK(bad("my\xD0\xB0gent").reason == NameReason::mixed_script); // Cyrillic а

  auto r = bad("abcאבג").reason;
  CHECK((r == NameReason::mixed_script || r == NameReason::bidi_rule));

  CHECK(bad("").reason == NameReason::empty);
  CHECK(bad("   ").reason == NameReason::empty);
  CHECK(bad(std::string(65, 'a')).reason == NameReason::too_long);
  CHECK(ok(std::string(64, 'a')) == std::string(64, 'a'));
}

TEST_CASE("spec5_confusables_share_a_skeleton", "[names]") {
  auto cyr = mep::canonicalize("раура"); // all Cyrillic
  REQUIRE(cyr);
  auto lat = mep::canonicalize("paypa");
  REQUIRE(lat);
  CHECK(cyr->canonical_name != lat->canonical_name);
  CHECK(cyr->skeleton == lat->skeleton);
  CHECK(cyr->scripts == std::vector<std::string>{"Cyrillic"});

  auto one = mep::canonicalize("agent_1");
  auto ell = mep::canonicalize("agent_l");
  REQUIRE(one);
  REQUIRE(ell);
  CHECK(one->canonical_name != ell->canonical_name);
  CHECK(one->skeleton == ell->skeleton);

  auto sz = mep::canonicalize("Straße");
  auto ss = mep::canonicalize("STRASSE");
  REQUIRE(sz);
  REQUIRE(ss);
  CHECK(sz->canonical_name != ss->canonical_name);
}

TEST_CASE("skeleton_of_myagent", "[names]") {
  auto r = mep::canonicalize("myagent");
  REQUIRE(r);
  CHECK(r->skeleton == "rnyagent");
  CHECK(r->scripts == std::vector<std::string>{"Latin"});
}

TEST_CASE("input_rules_bytes_utf8_controls", "[names]") {
  CHECK(bad(std::string(257, 'a')).reason == NameReason::too_long);
  auto e = bad("ab\xFF");
  CHECK(e.reason == NameReason::invalid_utf8);
  CHECK(e.index == 2);
  CHECK(bad("\xC0\xAF").reason == NameReason::invalid_utf8);         // overlong
  CHECK(bad("\xED\xA0\x80").reason == NameReason::invalid_utf8);     // surrogate
  CHECK(bad("\xF4\x90\x80\x80").reason == NameReason::invalid_utf8); // > U+10FFFF
  e = bad(std::string("ab\0c", 4));
  CHECK(e.reason == NameReason::disallowed_character);
  CHECK(e.codepoint == 0);
  CHECK(e.index == 2);
  e = bad("\tagent");
  CHECK(e.codepoint == 0x09);
  CHECK(bad("a\xC2\x85").codepoint == 0x85); // C1 control NEL
}

TEST_CASE("display_name_is_trimmed_nfc", "[names]") {
  auto r = mep::canonicalize("  Cafe\xCC\x81 Bot \xE3\x80\x80");
  REQUIRE(r);
  CHECK(r->display_name == "Caf\xC3\xA9 Bot");
  CHECK(r->canonical_name == "caf\xC3\xA9"
                             "bot");
}

TEST_CASE("agent_policy_letters_marks_digits_dash_underscore", "[names]") {
  CHECK(ok("a-b_c9") == "a-b_c9");
  CHECK(ok("123") == "123");
  CHECK(bad("-ab").codepoint == U'-');
  CHECK(bad("ab_").codepoint == U'_');
  CHECK(bad("a.b").codepoint == U'.');
  CHECK(bad("a#b").index == 1);
  auto e = bad("My Agent!");
  CHECK(e.codepoint == U'!');
  CHECK(e.index == 8); // the position in what the user typed, spaces included
  e = bad("\xCC\x81"
          "abc"); // a mark without a base
  CHECK(e.reason == NameReason::disallowed_character);
}

TEST_CASE("error_index_counts_input_code_points", "[names]") {
  // Fullwidth '！' maps to '!' — the index still points at the input character.
  auto e = bad("\xC3\xA9t\xC3\xA9\xEF\xBC\x81");
  CHECK(e.codepoint == U'!');
  CHECK(e.index == 3);
}

TEST_CASE("uts39_mixed_numbers_and_invisible", "[names]") {
  // Latin digits mixed with Bengali digits.
  CHECK(bad("1\xE0\xA7\xA8").reason == NameReason::mixed_numbers); // 1 and Bengali 2
  CHECK(bad("a1\xE0\xA7\xA8").reason == NameReason::mixed_script); // Latin + Bengali
  // The same non-spacing mark twice on one base.
  CHECK(bad("a\xCC\x88\xCC\x88").reason == NameReason::invisible_character);
}

TEST_CASE("uts39_checks_reports_each_check_and_the_level", "[names]") {
  using mep::RestrictionLevel;
  auto c = mep::uts39_checks("abc");
  REQUIRE(c);
  CHECK(c->level == RestrictionLevel::ascii);
  CHECK(c->highly_restrictive);
  CHECK_FALSE(c->mixed_numbers);
  CHECK_FALSE(c->invisible);

  c = mep::uts39_checks("\xD0\xB0"
                        "bc"); // Cyrillic а + Latin
  REQUIRE(c);
  CHECK(c->level == RestrictionLevel::minimally_restrictive);
  CHECK_FALSE(c->highly_restrictive);
  CHECK(mep::uts39_check("\xD0\xB0"
                         "bc") == NameReason::mixed_script);

  c = mep::uts39_checks("a1\xD9\xA1"); // a, 1, Arabic-Indic 1 (ICU's testMixedNumbers)
  REQUIRE(c);
  CHECK(c->level == RestrictionLevel::moderately_restrictive);
  CHECK(c->mixed_numbers);

  c = mep::uts39_checks("abcd\xCC\x81\xCC\x82\xCC\x81"
                        "ef"); // ICU's testInvisible
  REQUIRE(c);
  CHECK(c->invisible);
  CHECK(c->highly_restrictive);
  CHECK(mep::uts39_check("abcd\xCC\x81\xCC\x82\xCC\x81"
                         "ef") == NameReason::invisible_character);

  // ICU checks an ill-formed sequence as U+FFFD.
  auto bad_utf8 = mep::uts39_checks("a\xFF");
  auto replaced = mep::uts39_checks("a\xEF\xBF\xBD");
  REQUIRE(bad_utf8);
  REQUIRE(replaced);
  CHECK(bad_utf8->level == replaced->level);
}

TEST_CASE("restriction_level_depends_on_the_allowed_set", "[names]") {
  using mep::AllowedSet;
  using mep::restriction_level;
  using mep::RestrictionLevel;
  CHECK(restriction_level("a!") == RestrictionLevel::ascii);
  CHECK(restriction_level("a!", AllowedSet::identifier) == RestrictionLevel::unrestrictive);
  // '-' is in ICU's inclusion set, not in its recommended set.
  CHECK(restriction_level("a-b", AllowedSet::identifier) == RestrictionLevel::ascii);
  CHECK(restriction_level("a-b", AllowedSet::recommended) == RestrictionLevel::unrestrictive);
  // ICU's testRestrictionLevel: "recommended + U+303C".
  CHECK(restriction_level("a\xE3\x80\xBC", AllowedSet::recommended) == RestrictionLevel::unrestrictive);
  CHECK(restriction_level("a\xE3\x80\xBC", AllowedSet::recommended, U"\u303C") == RestrictionLevel::highly_restrictive);
  CHECK(restriction_level("\xCE\xB3") == RestrictionLevel::single_script_restrictive); // γ
  CHECK(mep::to_string(RestrictionLevel::highly_restrictive) == "HIGHLY_RESTRICTIVE");
  CHECK(mep::to_string(RestrictionLevel::unrestrictive) == "UNRESTRICTIVE");
}

TEST_CASE("highly_restrictive_allows_japanese_with_latin", "[names]") {
  auto r = mep::canonicalize("abcひらがなカタカナ漢字");
  REQUIRE(r);
  CHECK(r->scripts.size() == 4);
}

TEST_CASE("canonical_names_are_fixed_points", "[names]") {
  for (const char* in :
       {"My Agent", "ΟΔΟΣ", "Straße", "раура", "e\xCC\x81", "ＭｙＡｇｅｎｔ", "abcひらがな", "agent_1"}) {
    auto r = mep::canonicalize(in);
    REQUIRE(r);
    auto again = mep::canonicalize(r->canonical_name);
    REQUIRE(again);
    CHECK(again->canonical_name == r->canonical_name);
    CHECK(again->skeleton == r->skeleton);
  }
}

TEST_CASE("ascii_fast_path_agrees_with_general_path", "[names]") {
  std::mt19937 rng(12345);
  const std::string alphabet = "abcXYZ019-_ .!~|Il0O mM\x7f\t";
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    int len = static_cast<int>(rng() % 12);
    for (int k = 0; k < len; ++k) s.push_back(alphabet[rng() % alphabet.size()]);
    std::vector<mep::ExplainStep> steps;
    auto fast = mep::canonicalize(s);
    auto slow = mep::canonicalize(s, &steps); // explain forces the general path
    INFO("input: '" << s << "'");
    REQUIRE(fast.has_value() == slow.has_value());
    if (fast) {
      CHECK(fast->canonical_name == slow->canonical_name);
      CHECK(fast->display_name == slow->display_name);
      CHECK(fast->skeleton == slow->skeleton);
      CHECK(fast->scripts == slow->scripts);
    } else {
      CHECK(fast.error().reason == slow.error().reason);
      CHECK(fast.error().codepoint == slow.error().codepoint);
      CHECK(fast.error().index == slow.error().index);
    }
  }
}

TEST_CASE("ascii_skeleton_table_matches_icu", "[names]") {
  std::mt19937 rng(7);
  for (int i = 0; i < 5000; ++i) {
    std::string s;
    int len = 1 + static_cast<int>(rng() % 20);
    for (int k = 0; k < len; ++k) s.push_back(static_cast<char>(0x20 + rng() % 95));
    // Appending a non-ASCII letter forces ICU; strip its skeleton again.
    std::string forced = mep::confusable_skeleton(s + "\xC3\xA6"); // æ → ae
    REQUIRE(forced.size() >= 2);
    CHECK(mep::confusable_skeleton(s) + "ae" == forced);
  }
}

TEST_CASE("explain_lists_each_step", "[names]") {
  std::vector<mep::ExplainStep> steps;
  auto r = mep::canonicalize("My Agent", &steps);
  REQUIRE(r);
  REQUIRE(steps.size() >= 6);
  CHECK(steps.front().value == "My Agent");
  CHECK(steps.back().step == "skeleton");
  CHECK(steps.back().value == "rnyagent");
}

TEST_CASE("usernamecasemapped_profile_alone", "[names]") {
  auto r = mep::username_case_mapped("Juliet");
  REQUIRE(r);
  CHECK(*r == "juliet");
  // No space removal and no agent policy: '!' is PVALID in the IdentifierClass.
  CHECK(*mep::username_case_mapped("agent!") == "agent!");
  auto sp = mep::username_case_mapped("My Agent");
  REQUIRE_FALSE(sp);
  CHECK(sp.error().precis_error == "spaces");
  CHECK(sp.error().index == 2);
}

TEST_CASE("name_error_problem_shape", "[names]") {
  auto e = bad("agent!");
  auto p = e.to_problem();
  CHECK(p.status() == 422);
  CHECK(p.slug() == "invalid-name");
  auto o = p.to_json();
  CHECK(o.at("reason").as_string() == "disallowed-character");
  CHECK(o.at("codepoint").as_string() == "U+0021");
  CHECK(o.at("index").as_int64() == 5);
}
