// Strict JSON parsing and the request reader.
#include "mep/json.hpp"

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>
#include <catch2/catch.hpp>

using mep::json::Need;

TEST_CASE("parse_object_rejects_non_objects_and_garbage", "[json]") {
  REQUIRE(mep::json::parse_object("{\"a\":1}"));
  for (const char* bad : {"", "[]", "1", "{", "{\"a\":1} x", "{\"a\":\"\xff\"}", "nul"}) {
    auto r = mep::json::parse_object(bad);
    REQUIRE_FALSE(r);
    REQUIRE(r.error().code == mep::Code::invalid_request);
  }
  std::string deep(100, '[');
  REQUIRE_FALSE(mep::json::parse_object("{\"a\":" + deep + "}"));
}

TEST_CASE("object_reader_reads_typed_fields", "[json]") {
  auto o = *mep::json::parse_object(R"({"name":"x","ttl":30,"id":"0190F5B2-3C4D-7E8F-9A0B-1C2D3E4F5A6B","f":30.0})");
  mep::json::ObjectReader r(o);
  REQUIRE(r.string("name", Need::required) == "x");
  REQUIRE(r.integer("ttl", Need::required, 5, 300) == 30);
  REQUIRE(r.uuid("id", Need::required) == "0190f5b2-3c4d-7e8f-9a0b-1c2d3e4f5a6b");
  REQUIRE(r.integer("f", Need::required, 5, 300) == 30);
  REQUIRE_FALSE(r.string("absent", Need::optional));
  REQUIRE(r.finish());
}

TEST_CASE("object_reader_names_every_problem", "[json]") {
  auto o = *mep::json::parse_object(R"({"name":5,"ttl":1e30,"id":"nope","extra":1,"zzz":null})");
  mep::json::ObjectReader r(o);
  r.string("name", Need::required);
  r.integer("ttl", Need::required, 5, 300);
  r.uuid("id", Need::required);
  r.string("missing", Need::required);
  auto res = r.finish();
  REQUIRE_FALSE(res);
  const auto& d = res.error().detail;
  CHECK(d.find("\"name\" must be a string") != std::string::npos);
  CHECK(d.find("\"ttl\" must be an integer between 5 and 300") != std::string::npos);
  CHECK(d.find("\"id\" must be a UUID") != std::string::npos);
  CHECK(d.find("missing field \"missing\"") != std::string::npos);
  CHECK(d.find("unknown fields \"extra\", \"zzz\"") != std::string::npos);
  REQUIRE(res.error().extensions.at("unknown_fields").as_array().size() == 2);
}

TEST_CASE("object_reader_fraction_is_not_an_integer", "[json]") {
  // Not "between MIN and MAX": the bounds of a field checked later (a TTL) are internal.
  auto o = *mep::json::parse_object(R"({"ttl":5.5})");
  mep::json::ObjectReader r(o);
  REQUIRE_FALSE(r.integer("ttl", Need::required, -1099511627776, 1099511627776));
  auto res = r.finish();
  REQUIRE_FALSE(res);
  CHECK(res.error().detail.find("\"ttl\" must be an integer") != std::string::npos);
  CHECK(res.error().detail.find("between") == std::string::npos);
}

TEST_CASE("integer_rejects_fractions_negative_and_huge", "[json]") {
  for (const char* body :
       {R"({"n":1.5})", R"({"n":-1})", R"({"n":18446744073709551615})", R"({"n":"5"})", R"({"n":true})"}) {
    auto o = *mep::json::parse_object(body);
    mep::json::ObjectReader r(o);
    REQUIRE_FALSE(r.integer("n", Need::required, 0, 1000));
    REQUIRE_FALSE(r.finish());
  }
}

TEST_CASE("canonical_json_sorts_keys_recursively", "[json]") {
  auto v = boost::json::parse(R"({"b":1,"a":{"d":[{"y":1,"x":2}],"c":"s"}})");
  REQUIRE(mep::json::canonical(v) == R"({"a":{"c":"s","d":[{"x":2,"y":1}]},"b":1})");
}

TEST_CASE("append_string_escapes_and_repairs_utf8", "[json]") {
  std::string out;
  mep::json::append_string(out, std::string("a\"b\\c\n\x01\xc3\xa9\xff", 10));
  REQUIRE(out == "\"a\\\"b\\\\c\\n\\u0001\xc3\xa9\xef\xbf\xbd\"");
  REQUIRE(boost::json::parse(out).as_string().size() > 0);
  out.clear();
  mep::json::append_string(out, "\xed\xa0\x80"); // an encoded surrogate is not UTF-8
  REQUIRE(out == "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"");
}

TEST_CASE("parse_object_refuses_duplicate_keys", "[json]") {
  auto detail = [](std::string_view text) {
    auto r = mep::json::parse_object(text);
    return r ? std::string() : r.error().detail;
  };
  CHECK(detail(R"({"a":1,"a":2})") == "field \"a\" appears twice in one object");
  CHECK(detail(R"({"x":{"b":1,"c":2,"b":3}})") == "field \"b\" appears twice in one object");
  CHECK(detail(R"({"leases":[{"k":1},{"k":2,"k":3}]})") == "field \"k\" appears twice in one object");
  CHECK(detail(R"({"a":1,"\u0061":2})") == "field \"a\" appears twice in one object"); // compared unescaped
  // The same key in different objects, or as a value, is fine.
  CHECK(mep::json::parse_object(R"({"a":{"a":1},"b":[{"a":1},{"a":2}],"c":"a"})"));
  // Other errors keep their own words.
  CHECK(detail(R"({"a":1,)").rfind("malformed JSON", 0) == 0);
}

TEST_CASE("parse_object_refuses_numbers_beyond_a_double", "[json]") {
  // Boost.JSON reads 1e400 as infinity, which no JSON writer can write back.
  for (const char* text : {R"({"a":1e400})", R"({"a":-3e999})", R"({"a":[1,{"b":300000000000000000000000E800}]})"}) {
    INFO(text);
    auto r = mep::json::parse_object(text);
    REQUIRE_FALSE(r);
    REQUIRE(r.error().detail == "a number is too large for a 64-bit floating-point value");
  }
  REQUIRE(mep::json::parse_object(R"({"a":1.7976931348623157e308,"b":18446744073709551616})"));
}

TEST_CASE("dump_always_writes_valid_json", "[json]") {
  // A problem's detail may quote a percent-decoded query parameter: "%da" is byte 0xDA.
  boost::json::object o{{"detail", "unknown query parameter \"a\xda"
                                   "b\""},
                        {"k\xff", boost::json::array{"\xc3\xa9", "\xed\xa0\x80"}}};
  const std::string out = mep::json::dump(o);
  auto back = mep::json::parse_object(out);
  REQUIRE(back);
  REQUIRE(back->at("detail").as_string() == "unknown query parameter \"a\xEF\xBF\xBD"
                                            "b\"");
  REQUIRE(back->at("k\xEF\xBF\xBD").as_array().at(0).as_string() == "\xc3\xa9");
  REQUIRE(back->at("k\xEF\xBF\xBD").as_array().at(1).as_string() == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  // Valid input is what Boost.JSON writes.
  boost::json::object fine{{"a", 1}, {"b", "z\xc3\xa9"}, {"c", 1.5}};
  REQUIRE(mep::json::dump(fine) == boost::json::serialize(fine));
}
