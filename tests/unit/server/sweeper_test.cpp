// sweep_spacing: how long a sweep keeps the next one away (PostgreSQL's scan the leases table).
#include "mep/sweeper.hpp"

#include <catch2/catch.hpp>

using namespace std::chrono_literals;
using mep::server::k_max_sweep_spacing;
using mep::server::k_sweep_batch;
using mep::server::k_sweep_cost_ratio;
using mep::server::sweep_spacing;

TEST_CASE("sweeper: a sweep keeps the next one away for its cost ratio times as long as it took", "[sweeper]") {
  CHECK(sweep_spacing(2ms, 0) == 2ms * k_sweep_cost_ratio);
  CHECK(sweep_spacing(130ms, 17) == 130ms * k_sweep_cost_ratio);
  // Rounded up, so that a sweep shorter than a millisecond still spaces the next.
  CHECK(sweep_spacing(std::chrono::microseconds(10), 0) == 1ms);
  // A million leases took 125-150 ms here: the next sweep 6-8 s later, not every second.
  CHECK(sweep_spacing(150ms, 0) > 7s);
}

TEST_CASE("sweeper: the spacing has a ceiling, however slow the sweep", "[sweeper]") {
  CHECK(sweep_spacing(k_max_sweep_spacing / k_sweep_cost_ratio, 0) == k_max_sweep_spacing);
  CHECK(sweep_spacing(5s, 0) == k_max_sweep_spacing);
  CHECK(sweep_spacing(std::chrono::hours(3), 0) == k_max_sweep_spacing);
}

TEST_CASE("sweeper: a full sweep (a backlog) lets the next one run at once", "[sweeper]") {
  CHECK(sweep_spacing(400ms, k_sweep_batch) == 0ms);
  CHECK(sweep_spacing(400ms, k_sweep_batch + 4000) == 0ms);
  CHECK(sweep_spacing(400ms, k_sweep_batch - 1) == 400ms * k_sweep_cost_ratio);
}

TEST_CASE("sweeper: a sweep that took no time (a clock that did not move) does not hold the next back", "[sweeper]") {
  CHECK(sweep_spacing(0ns, 0) == 0ms);
  CHECK(sweep_spacing(-5ms, 0) == 0ms);
}
