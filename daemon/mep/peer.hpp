// Who a request to mepd comes from, and acting on files as that peer (SPEC §7, system mode).
//
// A system mepd (`mepd --system`) serves every member of the group `mep` on one socket. It
// must not become a confused deputy: a user may attach, create, read or copy only the files
// that user could open alone, and a file the daemon creates for a user belongs to that user.
// So every file-system call made for a request runs with the peer's credentials: Linux keeps
// the file-system uid and gid and the supplementary groups per thread (setfsuid(2),
// setfsgid(2), and the raw setgroups system call, which glibc would otherwise apply to every
// thread), and the kernel then checks each open, create, xattr and /proc access exactly as
// it would for the peer. Leases carry the uid that attached them; a peer sees and acts on its
// own, root and the daemon's own user on all.
#pragma once
#include "mep/problem.hpp"

#include <optional>
#include <sys/types.h>
#include <vector>

namespace mep::daemon {

/// A local client: SO_PEERCRED's uid, gid and pid, and its supplementary groups.
struct Peer {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  std::vector<gid_t> groups;

  /// The connected process, with the groups it had when it connected (SO_PEERGROUPS); when
  /// they are unknown, only `gid` — never the user's group list, which holds groups the
  /// process may have dropped.
  static Peer connected(uid_t uid, gid_t gid, pid_t pid, const std::optional<std::vector<gid_t>>& groups);
  /// A lease's owner known by uid and gid only (a process that exited, a lease re-adopted
  /// after a restart): the user's group list.
  static Peer user(uid_t uid, gid_t gid);
};

/// True when a peer running as `viewer` may see and act on a lease attached by `owner`:
/// its own; every lease for root and for the daemon's own user.
bool may_act_on(uid_t viewer, uid_t owner);

/// The peer the calling thread serves now (set by PeerScope), or null.
const Peer* current_peer();

/// Sets current_peer() for this thread while it lives (one request, one lease's release).
class PeerScope {
public:
  explicit PeerScope(const Peer* peer);
  ~PeerScope();
  PeerScope(const PeerScope&) = delete;
  PeerScope& operator=(const PeerScope&) = delete;

private:
  const Peer* m_previous;
};

/// While it lives, this thread's file-system calls run with current_peer()'s credentials;
/// the daemon's own come back on destruction. A no-op without a current peer, for a peer
/// that is the daemon's own user, and inside another AsPeer for the same peer. Throws
/// std::runtime_error when the kernel refuses the switch (mepd without CAP_SETUID and
/// CAP_SETGID): the file is then not touched at all, never touched as the daemon.
class AsPeer {
public:
  AsPeer();
  ~AsPeer();
  AsPeer(const AsPeer&) = delete;
  AsPeer& operator=(const AsPeer&) = delete;

private:
  bool m_switched = false;
  uid_t m_fsuid = 0;
  gid_t m_fsgid = 0;
  std::vector<gid_t> m_groups;
};

/// The uid whose records identity resolution uses: the current peer's, else the daemon's.
/// Each local user has a path map of its own (state_db), so one user's files never lend
/// their identity to another's, and a lookup tells nothing of another user's files.
uid_t acting_uid();
/// The daemon's effective uid, read once (mepd switches its file-system ids, never its euid).
uid_t daemon_euid();

/// True when `uid` is root or the daemon's own user (they act on every user's leases).
bool acts_for_all(uid_t uid);

/// open(2) of `path` as the current peer (AsPeer), refusing to pass through /proc's magic
/// links (openat2 RESOLVE_NO_MAGICLINKS): /proc/self/fd/N or /proc/PID/cwd would be
/// resolved in the daemon's own process, past the directories that guard the file. -1 with
/// errno set (ELOOP for a magic link).
int open_as_peer(const char* path, int flags, mode_t mode = 0);

/// Checks that this process can act as another user (system mode needs it); the reason
/// when it cannot.
std::optional<std::string> check_can_act_as_peers();

/// 403 forbidden unless the current peer could open `path` for writing itself (system mode:
/// a file is attached only then); 400 when there is no such file.
std::optional<Problem> check_peer_may_write(const char* path);

} // namespace mep::daemon
