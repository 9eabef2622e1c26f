// See clock_watch.hpp.
#include "mep/clock_watch.hpp"

namespace mep::server {

std::optional<ClockWatch::Step> ClockWatch::check(std::int64_t clock_ms, std::int64_t sent_boot_ms,
                                                  std::int64_t got_boot_ms) const {
  const std::int64_t offset = m_offset.load();
  const std::int64_t rtt = got_boot_ms - sent_boot_ms;
  if (offset == k_none || rtt < 0 || rtt > k_max_round_trip_ms) return std::nullopt;
  const std::int64_t mid = sent_boot_ms + rtt / 2;
  const std::int64_t expected = mid + offset;
  const std::int64_t slack = k_tolerance_ms + (rtt + 1) / 2 + m_error.load();
  const std::int64_t diff = clock_ms - expected;
  if (diff > slack || diff < -slack) return Step{expected - slack, clock_ms, diff};
  return std::nullopt;
}

void ClockWatch::anchor(std::int64_t clock_ms, std::int64_t sent_boot_ms, std::int64_t got_boot_ms) {
  const std::int64_t rtt = got_boot_ms - sent_boot_ms;
  if (rtt < 0 || rtt > k_max_round_trip_ms) return;
  m_error.store((rtt + 1) / 2);
  m_offset.store(clock_ms - (sent_boot_ms + rtt / 2));
}

std::optional<std::int64_t> ClockWatch::bound(std::int64_t boot_ms) const {
  const std::int64_t offset = m_offset.load();
  if (offset == k_none) return std::nullopt;
  return boot_ms + offset + m_error.load() + k_tolerance_ms;
}

} // namespace mep::server
