// The sweeper (SPEC §3 L5): expired leases and idempotency records are removed, so storage
// does not grow with churn; on SQLite each pass also saves the lease clock's checkpoint.
#pragma once
#include "mep/log.hpp"
#include "mep/store.hpp"

#include <chrono>
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <string>
#include <mutex>
#include <thread>

namespace mep::server {

/// A sweep may cost at most this share of the time (PostgreSQL: 1/50 of the database's time
/// per server): its lease part scans the whole `leases` table there, which has no index on
/// `expires_at` so that renewals are HOT updates (server/pg/schema/v07.sql). About 20 ms a sweep
/// at 100,000 leases and 130 ms at 1,000,000: every second would cost a million-lease
/// database an eighth of a core per server for nothing.
inline constexpr int k_sweep_cost_ratio = 50;
/// The longest a store waits between two sweeps, however slow the last one was.
inline constexpr std::chrono::milliseconds k_max_sweep_spacing{30'000};

/// How long after the start of a sweep that took `took` and removed `removed` rows the next
/// may run: `k_sweep_cost_ratio` times as long as it took (at most k_max_sweep_spacing), or
/// at once when it was full (a backlog: more rows end per second than one sweep removes).
inline std::chrono::milliseconds sweep_spacing(std::chrono::nanoseconds took, std::int64_t removed) {
  if (removed >= k_sweep_batch) return std::chrono::milliseconds(0);
  if (took <= std::chrono::nanoseconds(0)) return std::chrono::milliseconds(0);
  if (took >= k_max_sweep_spacing / k_sweep_cost_ratio) return k_max_sweep_spacing;
  return std::chrono::ceil<std::chrono::milliseconds>(took * k_sweep_cost_ratio);
}

// Runs Store::sweep once a second until stopped (L5: storage does not grow with churn);
// again after 10 ms while sweeps come back full (a backlog: more rows end per second
// than one sweep removes). While sweeps fail (the database is down) the pause doubles up to
// 30 s, and the failure is logged when it starts, when its message changes and once a
// minute, not once a second.
class Sweeper {
public:
  /// Starts sweeping `store` (which must outlive the sweeper).
  explicit Sweeper(Store& store) : m_thread([this, &store] { loop(store); }) {}
  ~Sweeper() {
    {
      std::lock_guard lock(m_mutex);
      m_stop = true;
    }
    m_cv.notify_all();
    m_thread.join();
  }

private:
  void loop(Store& store) {
    using namespace std::chrono;
    std::unique_lock lock(m_mutex);
    milliseconds pause{1000};
    std::uint64_t failures = 0;
    std::string last_error;
    steady_clock::time_point last_logged{};
    while (!m_cv.wait_for(lock, pause, [&] { return m_stop; })) {
      lock.unlock();
      pause = milliseconds(1000);
      try {
        std::int64_t n = store.sweep();
        if (failures > 0) log::info("sweeper: sweeping again, after {} failed sweeps", failures);
        failures = 0;
        if (n > 0) log::debug("sweeper removed {} expired rows", n);
        if (n >= k_sweep_batch) pause = milliseconds(10);
      } catch (const std::exception& e) {
        ++failures;
        const auto now = steady_clock::now();
        if (failures == 1 || e.what() != last_error || now - last_logged >= minutes(1)) {
          log::warn("sweeper: {}{}", e.what(),
                    failures > 1 ? fmt::format(" ({} sweeps failed in a row)", failures) : std::string());
          last_error = e.what();
          last_logged = now;
        }
        pause = std::min<milliseconds>(milliseconds(1000LL << std::min<std::uint64_t>(failures - 1, 5)), seconds(30));
      }
      lock.lock();
    }
  }
  std::mutex m_mutex;
  std::condition_variable m_cv;
  bool m_stop = false;
  std::thread m_thread;
};

} // namespace mep::server
