// The sweeper (SPEC §3 L5): expired leases and idempotency records are removed, so storage
// does not grow with churn; on SQLite each pass also saves the lease clock's checkpoint.
#pragma once
#include "mep/log.hpp"
#include "mep/store.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>

namespace mep::server {

// Runs Store::sweep once a second until stopped (L5: storage does not grow with churn);
// again after 10 ms while sweeps come back full (a backlog: more rows end per second
// than one sweep removes).
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
    std::unique_lock lock(m_mutex);
    std::chrono::milliseconds pause{1000};
    while (!m_cv.wait_for(lock, pause, [&] { return m_stop; })) {
      lock.unlock();
      pause = std::chrono::milliseconds(1000);
      try {
        std::int64_t n = store.sweep();
        if (n > 0) log::debug("sweeper removed {} expired rows", n);
        if (n >= k_sweep_batch) pause = std::chrono::milliseconds(10);
      } catch (const std::exception& e) {
        log::warn("sweeper: {}", e.what());
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
