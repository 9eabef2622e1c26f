// A token bucket per bearer token (SPEC §6): `rate` requests per second, bursts of
// `rate`. A rate of 0 turns limiting off.
#pragma once
#include <chrono>
#include <mutex>
#include <string>
#include <unordered_map>

namespace mep::server {

class RateLimiter {
public:
  explicit RateLimiter(double rate) : m_rate(rate) {}

  /// Takes one token for `key`, leaving at least `reserve` tokens in the bucket (requests
  /// of lower priority keep a reserve for the others). Returns 0 when allowed, else the
  /// seconds to wait (at least 1) before a token is available.
  int acquire(const std::string& key, double reserve = 0);
  double rate() const { return m_rate; }

private:
  struct Bucket {
    double tokens;
    std::chrono::steady_clock::time_point last;
  };
  double m_rate;
  std::mutex m_mutex;
  std::unordered_map<std::string, Bucket> m_buckets;
};

} // namespace mep::server
