// Wall-clock time in Unix milliseconds and its RFC 3339 text form; the lease clock.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace mep {

/// Milliseconds since the Unix epoch, UTC.
using UnixMs = std::int64_t;

/// The current system time in Unix milliseconds.
UnixMs now_unix_ms();

/// RFC 3339 UTC with exactly three fraction digits: `2026-07-14T19:12:50.123Z`.
/// Years outside 0000..9999 are clamped to that range.
std::string format_rfc3339_ms(UnixMs ms);

/// Milliseconds of CLOCK_BOOTTIME: real time since this boot, suspend included; wall-clock
/// steps do not move it.
std::int64_t boot_ms();

/// This boot's id (/proc/sys/kernel/random/boot_id), or empty when it cannot be read.
std::string boot_id();

/// The clock that decides lease expiry (SPEC §9): a wall-clock time at an anchor, advanced
/// by the monotonic clock since, so a step of the wall clock neither shortens nor stretches
/// a lease. Its readings are Unix milliseconds and equal the wall clock's until the wall
/// clock steps; to_wall() converts one for display.
class LeaseClock {
public:
  /// Reads `start` now (default: the wall clock).
  explicit LeaseClock(std::optional<UnixMs> start = std::nullopt);
  UnixMs now() const;
  /// `t` on this clock as the wall clock would read it (for RFC 3339 on the wire).
  UnixMs to_wall(UnixMs t) const { return t + (now_unix_ms() - now()); }

private:
  UnixMs m_start;
  std::int64_t m_steady_start_ns;
};

/// Parses an RFC 3339 date-time (`T` or `t`, fraction of any length, `Z` or a
/// ±hh:mm offset); the result is truncated to milliseconds. nullopt when malformed.
std::optional<UnixMs> parse_rfc3339(std::string_view text);

} // namespace mep
