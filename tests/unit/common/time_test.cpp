// RFC 3339 timestamps with milliseconds.
#include "mep/time.hpp"

#include <catch2/catch.hpp>

TEST_CASE("rfc3339_formats_utc_with_milliseconds", "[time]") {
  REQUIRE(mep::format_rfc3339_ms(0) == "1970-01-01T00:00:00.000Z");
  REQUIRE(mep::format_rfc3339_ms(1784056370123) == "2026-07-14T19:12:50.123Z");
  REQUIRE(mep::format_rfc3339_ms(951782400000) == "2000-02-29T00:00:00.000Z");
  REQUIRE(mep::format_rfc3339_ms(-1) == "1969-12-31T23:59:59.999Z");
}

TEST_CASE("rfc3339_parses_what_it_formats", "[time]") {
  for (mep::UnixMs ms : {0LL, 1LL, 999LL, 1784056370123LL, 951782400000LL, -86400001LL, 4102444799999LL}) {
    auto text = mep::format_rfc3339_ms(ms);
    auto back = mep::parse_rfc3339(text);
    REQUIRE(back);
    REQUIRE(*back == ms);
  }
}

TEST_CASE("rfc3339_parses_offsets_and_fractions", "[time]") {
  REQUIRE(mep::parse_rfc3339("2026-07-14T21:12:50.123+02:00") == 1784056370123);
  REQUIRE(mep::parse_rfc3339("2026-07-14t19:12:50z") == 1784056370000);
  REQUIRE(mep::parse_rfc3339("2026-07-14T19:12:50.1Z") == 1784056370100);
  REQUIRE(mep::parse_rfc3339("2026-07-14T19:12:50.123456789Z") == 1784056370123);
}

TEST_CASE("rfc3339_rejects_malformed", "[time]") {
  for (const char* bad :
       {"", "2026-07-14", "2026-07-14T19:12:50", "2026-13-01T00:00:00Z", "2026-02-30T00:00:00Z", "2026-07-14T24:00:00Z",
        "2026-07-14T19:12:50.Z", "2026-07-14T19:12:50+0200", "2026-07-14T19:12:50Zjunk", "x026-07-14T19:12:50Z"})
    REQUIRE_FALSE(mep::parse_rfc3339(bad));
}
