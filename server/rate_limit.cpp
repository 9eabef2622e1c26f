// Token-bucket rate limiting.
#include "mep/rate_limit.hpp"

#include <cmath>

namespace mep::server {

int RateLimiter::acquire(const std::string& key, double reserve) {
  if (m_rate <= 0) return 0;
  auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(m_mutex);
  auto [it, fresh] = m_buckets.try_emplace(key, Bucket{m_rate, now});
  Bucket& b = it->second;
  if (!fresh) {
    double elapsed = std::chrono::duration<double>(now - b.last).count();
    b.tokens = std::min(m_rate, b.tokens + elapsed * m_rate);
    b.last = now;
  }
  if (b.tokens >= 1 + reserve) {
    b.tokens -= 1;
    return 0;
  }
  return std::max(1, static_cast<int>(std::ceil((1 + reserve - b.tokens) / m_rate)));
}

} // namespace mep::server
