// The pid watcher (see pid_watch.hpp): one poll(2) over every watched pidfd and an eventfd
// that wakes it when the set changes.
#include "mep/pid_watch.hpp"

#include "mep/log.hpp"

#include <cerrno>
#include <cstring>
#include <csignal>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

namespace mep::daemon {

namespace {
int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }
} // namespace

bool pid_alive(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

PidWatcher::PidWatcher(std::function<void(pid_t)> on_exit) : m_on_exit(std::move(on_exit)) {
  m_wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
}

PidWatcher::~PidWatcher() {
  {
    std::lock_guard lock(m_mutex);
    m_stop = true;
  }
  std::uint64_t one = 1;
  if (m_wake_fd >= 0) (void)!::write(m_wake_fd, &one, sizeof one);
  if (m_thread.joinable()) m_thread.join();
  for (auto& [pid, fd] : m_pidfds)
    if (fd >= 0) ::close(fd);
  if (m_wake_fd >= 0) ::close(m_wake_fd);
}

int PidWatcher::open_pidfd(pid_t pid) {
  const int fd = pidfd_open(pid);
  if (fd >= 0) return fd;
  const int err = errno;
  const bool alive = pid_alive(pid);
  errno = err; // pid_alive's kill(2) must not hide why the open failed
  return alive ? k_retry : -1;
}

void PidWatcher::start() {
  m_thread = std::thread([this] { loop(); });
}

void PidWatcher::watch(pid_t pid) {
  {
    std::lock_guard lock(m_mutex);
    if (m_pidfds.count(pid)) return;
    const int fd = open_pidfd(pid);
    m_pidfds[pid] = fd;
    if (fd == k_retry)
      log::warn("pid watcher: cannot open a pidfd for process {} ({}); trying again", pid, std::strerror(errno));
  }
  std::uint64_t one = 1;
  (void)!::write(m_wake_fd, &one, sizeof one);
}

// An exit is reported only on the pidfd's word (POLLIN) or when the process cannot be found:
// a pidfd that could not be opened or went bad (POLLNVAL: closed under us) says nothing about
// the process, and releasing a live agent's leases on it would hand them to someone else
// while the agent works on (the soak found this under load).
void PidWatcher::loop() {
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<pid_t> pids;
    std::vector<pid_t> gone;
    std::vector<pid_t> retry;
    {
      std::lock_guard lock(m_mutex);
      if (m_stop) return;
      fds.push_back({m_wake_fd, POLLIN, 0});
      pids.push_back(0);
      for (auto& [pid, fd] : m_pidfds) {
        if (fd == k_retry) {
          retry.push_back(pid);
        } else if (fd < 0) {
          gone.push_back(pid);
        } else {
          fds.push_back({fd, POLLIN, 0});
          pids.push_back(pid);
        }
      }
    }
    if (gone.empty()) {
      ::poll(fds.data(), fds.size(), 200);
      if (fds[0].revents & POLLIN) {
        std::uint64_t v;
        (void)!::read(m_wake_fd, &v, sizeof v);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents & POLLIN) {
          gone.push_back(pids[i]);
        } else if (fds[i].revents) {
          std::lock_guard lock(m_mutex);
          auto it = m_pidfds.find(pids[i]);
          if (it == m_pidfds.end() || it->second != fds[i].fd) continue;
          log::warn("pid watcher: the pidfd of process {} went bad (poll events {:#x}); watching it again", pids[i],
                    static_cast<unsigned>(fds[i].revents));
          if (!(fds[i].revents & POLLNVAL)) ::close(it->second); // POLLNVAL: closed already
          it->second = k_retry;
          retry.push_back(pids[i]);
        }
      }
    }
    for (pid_t pid : retry) {
      std::lock_guard lock(m_mutex);
      auto it = m_pidfds.find(pid);
      if (it == m_pidfds.end() || it->second != k_retry) continue;
      it->second = open_pidfd(pid);
    }
    for (pid_t pid : gone) {
      {
        std::lock_guard lock(m_mutex);
        auto it = m_pidfds.find(pid);
        if (it == m_pidfds.end()) continue;
        if (it->second >= 0) ::close(it->second);
        m_pidfds.erase(it);
      }
      try {
        m_on_exit(pid);
      } catch (const std::exception& e) {
        log::error("releasing the leases of exited process {} failed: {}", pid, e.what());
      }
    }
  }
}

} // namespace mep::daemon
