// ClockWatch (server/clock_watch.cpp): steps of a clock we do not own, found against the
// boot clock, and the bound a claim carries until a step is recorded.
#include "mep/clock_watch.hpp"

#include <catch2/catch.hpp>

using mep::server::ClockWatch;

namespace {
constexpr std::int64_t wall = 1'800'000'000'000; // the watched clock at boot time 10 s
constexpr std::int64_t tol = ClockWatch::k_tolerance_ms;
} // namespace

TEST_CASE("clock watch: nothing to compare or bound before the first reading", "[clock_watch]") {
  ClockWatch w;
  REQUIRE(!w.bound(10'000));
  REQUIRE(!w.check(wall, 10'000, 10'002));
}

TEST_CASE("clock watch: a clock that keeps pace is no step, whatever the round trip", "[clock_watch]") {
  ClockWatch w;
  w.anchor(wall, 9'999, 10'001); // read at boot 10 000 ± 1
  // One second later (by the boot clock), a slow round trip of 400 ms: the reading was taken
  // somewhere inside it.
  REQUIRE(!w.check(wall + 1'000 + 150, 10'800, 11'200));
  REQUIRE(!w.check(wall + 1'000 - 150, 10'800, 11'200));
  // Drift well inside the tolerance.
  REQUIRE(!w.check(wall + 3'000 + tol - 10, 13'000, 13'000));
  REQUIRE(!w.check(wall + 3'000 - tol + 10, 13'000, 13'000));
}

TEST_CASE("clock watch: forward and backward steps, with their size and the window to hold", "[clock_watch]") {
  ClockWatch w;
  w.anchor(wall, 10'000, 10'000);
  auto fwd = w.check(wall + 1'000 + 60'000, 11'000, 11'000);
  REQUIRE(fwd);
  REQUIRE(fwd->size_ms == 60'000);
  REQUIRE(fwd->to_ms == wall + 61'000);
  // The window starts at what the clock should read, less the slack: leases that expired
  // before it had really expired.
  REQUIRE(fwd->from_ms == wall + 1'000 - tol);
  auto back = w.check(wall + 1'000 - 60'000, 11'000, 11'000);
  REQUIRE(back);
  REQUIRE(back->size_ms == -60'000);
  // check() leaves the anchor: the same step is found again until anchor() is called.
  REQUIRE(w.check(wall + 2'000 + 60'000, 12'000, 12'000));
  w.anchor(wall + 2'000 + 60'000, 12'000, 12'000);
  REQUIRE(!w.check(wall + 3'000 + 60'000, 13'000, 13'000));
}

TEST_CASE("clock watch: the bound is the anchor advanced by boot time, plus uncertainty and tolerance",
          "[clock_watch]") {
  ClockWatch w;
  w.anchor(wall, 10'000, 10'040); // mid 10 020, ± 20
  REQUIRE(*w.bound(10'020) == wall + 20 + tol);
  REQUIRE(*w.bound(15'020) == wall + 5'000 + 20 + tol);
  // A stepped clock does not move the bound until the step is recorded and anchored.
  (void)w.check(wall + 60'000, 10'020, 10'020);
  REQUIRE(*w.bound(10'020) == wall + 20 + tol);
}

TEST_CASE("clock watch: a reading with a round trip too long neither compares nor anchors", "[clock_watch]") {
  ClockWatch w;
  w.anchor(wall, 10'000, 10'000 + ClockWatch::k_max_round_trip_ms + 1);
  REQUIRE(!w.bound(10'000));
  w.anchor(wall, 10'000, 10'000);
  REQUIRE(!w.check(wall + 60'000, 11'000, 11'000 + ClockWatch::k_max_round_trip_ms + 1));
  REQUIRE(*w.bound(10'000) == wall + tol);
}
