// Watches a clock we do not own — PostgreSQL's, which decides lease expiry on that backend —
// against this process's monotonic clock (CLOCK_BOOTTIME), to find wall-clock steps of it
// (an NTP step, an operator's `date -s`) and to bound what it may honestly read (SPEC §9).
//
// Each reading is one round trip: the boot clock before and after, the watched clock in
// between. The first reading anchors; each later one is compared with the anchor advanced
// by the boot time since. A difference beyond the tolerance and the two readings' own
// uncertainty (half of each round trip) is a step. Pure arithmetic, no I/O: unit-tested.
#pragma once
#include <atomic>
#include <cstdint>
#include <optional>

namespace mep::server {

class ClockWatch {
public:
  /// A step smaller than this is not told from the noise of round trips and scheduling;
  /// it is below the daemon's smallest safety margin (1 s, SPEC §4).
  static constexpr std::int64_t k_tolerance_ms = 500;
  /// Readings whose round trip took longer are too uncertain to compare or anchor on.
  static constexpr std::int64_t k_max_round_trip_ms = 1000;

  struct Step {
    std::int64_t from_ms; ///< the earliest the clock should read now (anchor + boot time − uncertainty)
    std::int64_t to_ms;   ///< what it read
    std::int64_t size_ms; ///< to − expected: > 0 forward, < 0 backward
  };

  /// Compares a reading (`clock_ms`, taken between `sent_boot_ms` and `got_boot_ms`) with
  /// the anchor. Does not move the anchor: anchor() does, once a step found is recorded.
  /// nullopt when there is no step, no anchor yet, or the reading is too uncertain.
  std::optional<Step> check(std::int64_t clock_ms, std::int64_t sent_boot_ms, std::int64_t got_boot_ms) const;
  /// Makes the reading the anchor (ignored when too uncertain). Thread-safe with bound().
  void anchor(std::int64_t clock_ms, std::int64_t sent_boot_ms, std::int64_t got_boot_ms);
  /// The latest the watched clock can honestly read at `boot_ms` (anchor + boot time since +
  /// uncertainty + tolerance): a reading beyond it is a forward step not yet found. nullopt
  /// before the first anchor.
  std::optional<std::int64_t> bound(std::int64_t boot_ms) const;

private:
  static constexpr std::int64_t k_none = INT64_MIN;
  // clock − boot at the anchor, and the anchor's uncertainty. Written by one thread; read by
  // many (a torn pair only widens or narrows a bound by one round trip's uncertainty).
  std::atomic<std::int64_t> m_offset{k_none};
  std::atomic<std::int64_t> m_error{0};
};

} // namespace mep::server
