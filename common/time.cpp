// RFC 3339 timestamps, using Howard Hinnant's civil-date algorithms (public domain).
#include "mep/time.hpp"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>

namespace mep {
namespace {

constexpr std::int64_t days_from_civil(std::int64_t y, unsigned m, unsigned d) {
  y -= m <= 2;
  const std::int64_t era = (y >= 0 ? y : y - 399) / 400;
  const unsigned yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<std::int64_t>(doe) - 719468;
}

struct Civil {
  std::int64_t y;
  unsigned m, d;
};

constexpr Civil civil_from_days(std::int64_t z) {
  z += 719468;
  const std::int64_t era = (z >= 0 ? z : z - 146096) / 146097;
  const unsigned doe = static_cast<unsigned>(z - era * 146097);
  const unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
  const std::int64_t y = static_cast<std::int64_t>(yoe) + era * 400;
  const unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
  const unsigned mp = (5 * doy + 2) / 153;
  const unsigned d = doy - (153 * mp + 2) / 5 + 1;
  const unsigned m = mp < 10 ? mp + 3 : mp - 9;
  return {y + (m <= 2), m, d};
}

bool is_leap(std::int64_t y) { return y % 4 == 0 && (y % 100 != 0 || y % 400 == 0); }

unsigned days_in_month(std::int64_t y, unsigned m) {
  static constexpr unsigned k_days[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return m == 2 && is_leap(y) ? 29 : k_days[m - 1];
}

constexpr UnixMs k_min_ms = days_from_civil(0, 1, 1) * 86400000LL;
constexpr UnixMs k_max_ms = days_from_civil(10000, 1, 1) * 86400000LL - 1;

} // namespace

UnixMs now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string format_rfc3339_ms(UnixMs ms) {
  if (ms < k_min_ms) ms = k_min_ms;
  if (ms > k_max_ms) ms = k_max_ms;
  std::int64_t days = ms >= 0 ? ms / 86400000 : (ms - 86399999) / 86400000;
  std::int64_t rem = ms - days * 86400000;
  Civil c = civil_from_days(days);
  const auto r = static_cast<std::uint32_t>(rem); // 0 .. 86399999
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04u-%02u-%02uT%02u:%02u:%02u.%03uZ", static_cast<unsigned>(c.y), c.m, c.d,
                r / 3600000 % 24, r / 60000 % 60, r / 1000 % 60, r % 1000);
  return buf;
}

std::optional<UnixMs> parse_rfc3339(std::string_view t) {
  auto digits = [&](std::size_t pos, std::size_t n) -> std::optional<int> {
    if (pos + n > t.size()) return std::nullopt;
    int v = 0;
    for (std::size_t i = pos; i < pos + n; ++i) {
      if (t[i] < '0' || t[i] > '9') return std::nullopt;
      v = v * 10 + (t[i] - '0');
    }
    return v;
  };
  // full-date "T" partial-time
  if (t.size() < 20 || t[4] != '-' || t[7] != '-' || (t[10] != 'T' && t[10] != 't') || t[13] != ':' || t[16] != ':')
    return std::nullopt;
  auto y = digits(0, 4), mo = digits(5, 2), d = digits(8, 2);
  auto h = digits(11, 2), mi = digits(14, 2), s = digits(17, 2);
  if (!y || !mo || !d || !h || !mi || !s) return std::nullopt;
  if (*mo < 1 || *mo > 12 || *d < 1 || static_cast<unsigned>(*d) > days_in_month(*y, *mo) || *h > 23 || *mi > 59 ||
      *s > 60)
    return std::nullopt;
  std::size_t pos = 19;
  int ms = 0;
  if (pos < t.size() && t[pos] == '.') {
    ++pos;
    std::size_t start = pos;
    while (pos < t.size() && t[pos] >= '0' && t[pos] <= '9') {
      if (pos - start < 3) ms = ms * 10 + (t[pos] - '0');
      ++pos;
    }
    if (pos == start) return std::nullopt;
    for (std::size_t n = pos - start; n < 3; ++n) ms *= 10;
  }
  if (pos >= t.size()) return std::nullopt;
  int offset_min = 0;
  if (t[pos] == 'Z' || t[pos] == 'z') {
    ++pos;
  } else if (t[pos] == '+' || t[pos] == '-') {
    auto oh = digits(pos + 1, 2), om = digits(pos + 4, 2);
    if (!oh || !om || pos + 3 >= t.size() || t[pos + 3] != ':' || *oh > 23 || *om > 59) return std::nullopt;
    offset_min = (*oh * 60 + *om) * (t[pos] == '+' ? 1 : -1);
    pos += 6;
  } else {
    return std::nullopt;
  }
  if (pos != t.size()) return std::nullopt;
  int sec = *s == 60 ? 59 : *s; // a leap second is held at :59.999 territory
  std::int64_t days = days_from_civil(*y, static_cast<unsigned>(*mo), static_cast<unsigned>(*d));
  std::int64_t total = ((days * 24 + *h) * 60 + *mi - offset_min) * 60 + sec;
  return total * 1000 + ms;
}

std::int64_t boot_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_BOOTTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1'000'000;
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

namespace {
std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
} // namespace

LeaseClock::LeaseClock(std::optional<UnixMs> start)
    : m_start(start.value_or(now_unix_ms())), m_steady_start_ns(steady_ns()) {}

UnixMs LeaseClock::now() const { return m_start + (steady_ns() - m_steady_start_ns) / 1'000'000; }

} // namespace mep
