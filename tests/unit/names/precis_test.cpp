// PRECIS building blocks: derived properties, context rules, the Bidi Rule.
#include "mep/precis.hpp"

#include <catch2/catch.hpp>

using mep::precis::Property;

namespace {
std::optional<mep::precis::Error> id_class(std::u32string_view s) {
  return mep::precis::check_class(s, mep::precis::StringClass::identifier);
}
} // namespace

TEST_CASE("derived_property_examples", "[precis]") {
  using mep::precis::derived_property;
  CHECK(derived_property(U'a').property == Property::pvalid);
  CHECK(derived_property(U'a').reason == "ascii7");
  CHECK(derived_property(0x00DF).reason == "exceptions");
  CHECK(derived_property(0x0640).property == Property::disallowed);
  CHECK(derived_property(0x200D).property == Property::contextj);
  CHECK(derived_property(0x00B7).property == Property::contexto);
  CHECK(derived_property(0x1100).reason == "old_hangul_jamo");
  CHECK(derived_property(0x00AD).reason == "precis_ignorable_properties");
  CHECK(derived_property(0xFDD0).reason == "precis_ignorable_properties");
  CHECK(derived_property(0x0085).reason == "controls");
  CHECK(derived_property(0xFB01).reason == "has_compat");
  CHECK(derived_property(0x01C5).reason == "has_compat"); // Lt with compat decomposition
  CHECK(derived_property(0x2160).reason == "has_compat");
  CHECK(derived_property(0x00A0).reason == "has_compat");
  CHECK(derived_property(0x2028).reason == "other");
  CHECK(derived_property(0x1F600).reason == "symbols");
  CHECK(derived_property(0x0378).property == Property::unassigned);
  CHECK(derived_property(0xE000).reason == "other"); // private use
}

TEST_CASE("context_rules_rfc5892", "[precis]") {
  CHECK_FALSE(id_class(U"l\u00B7l"));
  CHECK(id_class(U"a\u00B7l")->name == "middle_dot");
  CHECK_FALSE(id_class(U"\u0375\u03B1"));
  CHECK(id_class(U"\u0375a")->name == "greek_keraia");
  CHECK_FALSE(id_class(U"\u05D0\u05F3"));
  CHECK(id_class(U"a\u05F4")->name == "hebrew_punctuation");
  CHECK_FALSE(id_class(U"\u30FB\u30A2"));
  CHECK(id_class(U"\u30FBa")->name == "katakana_middle_dot");
  CHECK_FALSE(id_class(U"\u0661\u0662"));
  CHECK(id_class(U"\u0661\u06F2")->name == "arabic_indic");
  CHECK(id_class(U"\u06F1\u0662")->name == "extended_arabic_indic");
  CHECK_FALSE(id_class(U"\u0915\u094D\u200D")); // virama then ZWJ
  CHECK(id_class(U"a\u200D")->name == "zero_width_joiner");
  CHECK_FALSE(id_class(U"\u0628\u200C\u0628")); // dual-joining on both sides
  CHECK(id_class(U"a\u200Cb")->name == "zero_width_nonjoiner");
}

TEST_CASE("bidi_rule_rfc5893", "[precis]") {
  using mep::precis::bidi_rule;
  CHECK(bidi_rule(U"\u05D0\u05D1"));
  CHECK(bidi_rule(U"\u05D0"
                  "1"));
  CHECK_FALSE(bidi_rule(U"1\u05D0")); // first must be L, R or AL
  CHECK_FALSE(bidi_rule(U"\u05D0a")); // L in an RTL label
  CHECK_FALSE(bidi_rule(U"\u0627"
                        "1\u0661")); // EN and AN together
  CHECK(bidi_rule(U"abc"));
  CHECK_FALSE(bidi_rule(U"abc\u05D0"));
  CHECK(bidi_rule(U"\u05D0\u05B0")); // trailing NSM
}
