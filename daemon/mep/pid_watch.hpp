// Watches agent processes (pidfd_open(2)) and reports their exit, SIGKILL included (SPEC
// §3 L6: a bound lease is released within 1 s of its agent's exit).
#pragma once
#include <functional>
#include <map>
#include <mutex>
#include <sys/types.h>
#include <thread>

namespace mep::daemon {

class PidWatcher {
public:
  /// `on_exit` runs on the watcher's thread, once per watched process that exited.
  explicit PidWatcher(std::function<void(pid_t)> on_exit);
  ~PidWatcher();
  PidWatcher(const PidWatcher&) = delete;
  PidWatcher& operator=(const PidWatcher&) = delete;

  void start();
  /// Watches `pid` (a process already gone is reported on the next pass).
  void watch(pid_t pid);

private:
  void loop();
  /// A pidfd for `pid`; -1 when the process is gone; k_retry when it lives but none could
  /// be opened (errno says why).
  static int open_pidfd(pid_t pid);
  std::function<void(pid_t)> m_on_exit;
  std::mutex m_mutex;
  // -1: could not be opened, the process is gone (reported on the next pass); k_retry:
  // could not be opened (EMFILE, ENOMEM…) although the process lives (tried each pass).
  static constexpr int k_retry = -2;
  std::map<pid_t, int> m_pidfds;
  bool m_stop = false;
  int m_wake_fd = -1;
  std::thread m_thread;
};

/// True while `pid` exists (kill(pid, 0) succeeds or is refused with EPERM).
bool pid_alive(pid_t pid);

} // namespace mep::daemon
