// Pauses of the whole machine during a benchmark cell, seen by a real-time probe thread.
//
// On a VM the host may stop every vCPU at once: here (Firecracker, 2 vCPUs) a few thousand
// fsyncs a second cost the VM about 10 ms of every 100 ms, whether its CPUs were busy or
// not (the host counts the disk emulation against the VM's CPU quota). A request in flight
// then waits out the pause, so such pauses alone put a latency percentile above their
// length: they belong next to any p99 measured here. The probe sleeps 500 µs at a time at
// SCHED_FIFO priority 1, so the guest's own scheduler cannot delay it (only the
// hypervisor, or a real-time thread of higher priority); a wake-up later than 1 ms past
// its time counts as a pause. Without the privilege to run real-time (not root), it runs at
// normal priority and says so: it then counts the guest's scheduling delays too.
#pragma once
#include <atomic>
#include <cerrno>
#include <chrono>
#include <pthread.h>
#include <sched.h>
#include <thread>
#include <time.h>

namespace mep::bench {

struct Stalls {
  double seconds = 0;  ///< how long the probe ran
  long count = 0;      ///< pauses longer than 1 ms
  double total_ms = 0; ///< their summed length beyond the 500 µs sleep
  double max_ms = 0;
  bool realtime = false; ///< whether the probe ran at SCHED_FIFO
  double percent() const { return seconds > 0 ? total_ms / (seconds * 10) : 0; }
};

class StallProbe {
public:
  StallProbe() : m_thread([this] { run(); }) {}
  ~StallProbe() { stop(); }
  StallProbe(const StallProbe&) = delete;
  StallProbe& operator=(const StallProbe&) = delete;

  /// Stops the probe (once) and returns what it saw.
  Stalls stop() {
    m_stop = true;
    if (m_thread.joinable()) m_thread.join();
    return m_result;
  }

private:
  static double now_ms() {
    timespec t{};
    ::clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
  }

  void run() {
    sched_param sp{};
    sp.sched_priority = 1;
    m_result.realtime = ::pthread_setschedparam(::pthread_self(), SCHED_FIFO, &sp) == 0;
    const double began = now_ms();
    const timespec nap{0, 500'000};
    while (!m_stop.load(std::memory_order_relaxed)) {
      const double before = now_ms();
      while (::clock_nanosleep(CLOCK_MONOTONIC, 0, &nap, nullptr) == EINTR) {}
      const double late = now_ms() - before - 0.5;
      if (late > 1.0) {
        ++m_result.count;
        m_result.total_ms += late;
        if (late > m_result.max_ms) m_result.max_ms = late;
      }
    }
    m_result.seconds = (now_ms() - began) / 1e3;
  }

  std::atomic<bool> m_stop{false};
  Stalls m_result;
  std::thread m_thread; // last: starts once the rest is made
};

} // namespace mep::bench
