// Wall-clock time in Unix milliseconds and its RFC 3339 text form.
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

/// Parses an RFC 3339 date-time (`T` or `t`, fraction of any length, `Z` or a
/// ±hh:mm offset); the result is truncated to milliseconds. nullopt when malformed.
std::optional<UnixMs> parse_rfc3339(std::string_view text);

} // namespace mep
