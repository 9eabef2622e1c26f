// Peers and per-thread file-system credentials (see peer.hpp).
#include "mep/peer.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <stdexcept>
#include <string>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace mep::daemon {

namespace {

thread_local const Peer* t_peer = nullptr;   // the peer this thread serves
thread_local const Peer* t_acting = nullptr; // the peer whose credentials are in force

// The calling thread's own: setfsuid/setfsgid with an invalid id change nothing and return
// the current value.
uid_t current_fsuid() { return static_cast<uid_t>(::setfsuid(static_cast<uid_t>(-1))); }
gid_t current_fsgid() { return static_cast<gid_t>(::setfsgid(static_cast<gid_t>(-1))); }

std::vector<gid_t> current_groups() {
  int n = ::getgroups(0, nullptr);
  std::vector<gid_t> g(static_cast<std::size_t>(n > 0 ? n : 0));
  if (n > 0) {
    n = ::getgroups(n, g.data());
    g.resize(static_cast<std::size_t>(n > 0 ? n : 0));
  }
  return g;
}

// This thread only: glibc's setgroups() would change every thread of the process.
bool set_thread_groups(const std::vector<gid_t>& groups) {
  return ::syscall(SYS_setgroups, groups.size(), groups.empty() ? nullptr : groups.data()) == 0;
}

std::vector<gid_t> user_groups(uid_t uid, gid_t gid) {
  passwd pw{};
  passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return {gid};
  int n = 64;
  std::vector<gid_t> groups(static_cast<std::size_t>(n));
  if (::getgrouplist(pw.pw_name, gid, groups.data(), &n) < 0) {
    groups.resize(static_cast<std::size_t>(n));
    if (::getgrouplist(pw.pw_name, gid, groups.data(), &n) < 0) return {gid};
  }
  groups.resize(static_cast<std::size_t>(n));
  return groups;
}

} // namespace

Peer Peer::connected(uid_t uid, gid_t gid, pid_t pid, const std::optional<std::vector<gid_t>>& groups) {
  Peer p{uid, gid, pid, {}};
  if (uid == daemon_euid()) return p; // the daemon's own user: never switched to (AsPeer)
  // Not /proc/PID/status: the process that connected may have exited, and its pid be
  // another process's by now.
  p.groups = groups ? *groups : std::vector<gid_t>{gid};
  return p;
}

Peer Peer::user(uid_t uid, gid_t gid) {
  if (uid == daemon_euid()) return Peer{uid, gid, 0, {}}; // never switched to: no group lookup
  return Peer{uid, gid, 0, user_groups(uid, gid)};
}

bool may_act_on(uid_t viewer, uid_t owner) { return acts_for_all(viewer) || viewer == owner; }

bool acts_for_all(uid_t uid) {
  static const uid_t real = ::getuid();
  return uid == 0 || uid == real;
}

uid_t daemon_euid() {
  static const uid_t euid = ::geteuid();
  return euid;
}

uid_t acting_uid() { return t_peer ? t_peer->uid : daemon_euid(); }

int open_as_peer(const char* path, int flags, mode_t mode) {
  AsPeer as;
  open_how how{};
  how.flags = static_cast<std::uint64_t>(flags | O_CLOEXEC);
  how.mode = (flags & (O_CREAT | O_TMPFILE)) ? mode : 0;
  how.resolve = RESOLVE_NO_MAGICLINKS;
  int fd = static_cast<int>(::syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how));
  if (fd < 0 && errno == ENOSYS) fd = ::open(path, flags | O_CLOEXEC, mode); // a kernel before 5.6
  return fd;
}

const Peer* current_peer() { return t_peer; }

PeerScope::PeerScope(const Peer* peer) : m_previous(t_peer) { t_peer = peer; }
PeerScope::~PeerScope() { t_peer = m_previous; }

AsPeer::AsPeer() {
  const Peer* p = t_peer;
  if (!p || t_acting == p) return;
  if (p->uid == daemon_euid()) return; // the daemon's own user (its groups may differ: newgrp)
  m_fsuid = current_fsuid();
  m_fsgid = current_fsgid();
  m_groups = current_groups();
  // Groups and gid first: changing them needs CAP_SETGID, which the fsuid switch keeps.
  const bool ok = set_thread_groups(p->groups) && (::setfsgid(p->gid), current_fsgid() == p->gid) &&
                  (::setfsuid(p->uid), current_fsuid() == p->uid);
  if (!ok) {
    ::setfsuid(m_fsuid);
    ::setfsgid(m_fsgid);
    set_thread_groups(m_groups);
    throw std::runtime_error(fmt::format("mepd cannot act as uid {} on its files (it needs CAP_SETUID and CAP_SETGID)",
                                         static_cast<long>(p->uid)));
  }
  m_switched = true;
  t_acting = p;
}

AsPeer::~AsPeer() {
  if (!m_switched) return;
  ::setfsuid(m_fsuid); // first: back to the daemon's uid brings its capabilities back
  ::setfsgid(m_fsgid);
  set_thread_groups(m_groups);
  t_acting = nullptr;
}

std::optional<std::string> check_can_act_as_peers() {
  // Someone else: nobody, or any uid that is not ours.
  const uid_t other = ::geteuid() == 65534 ? 65533 : 65534;
  const Peer probe{other, other, 0, {other}};
  PeerScope scope(&probe);
  try {
    AsPeer as;
    if (current_fsuid() != other) return "the switch of the file-system uid did not take";
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
  if (current_fsuid() != ::geteuid()) return "the file-system uid did not come back";
  return std::nullopt;
}

std::optional<Problem> check_peer_may_write(const char* path) {
  // O_NONBLOCK: a FIFO must not block the daemon; nothing is truncated or written.
  int fd = open_as_peer(path, O_WRONLY | O_NOCTTY | O_NONBLOCK);
  if (fd >= 0) {
    ::close(fd);
    return std::nullopt;
  }
  const int err = errno;
  if (err == EACCES || err == EPERM || err == EROFS || err == ELOOP)
    return Problem(Code::forbidden, "you cannot open this file for writing, so it cannot be attached for you");
  if (err == ENOENT) return Problem(Code::invalid_request, "no such file");
  return Problem(Code::invalid_request, std::string("cannot open the file for writing: ") + std::strerror(err));
}

} // namespace mep::daemon
