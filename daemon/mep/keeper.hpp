// The lease keeper: what mepd does for its agents (SPEC §7, §8) — attach and detach,
// branch, identify, init, lineage, verify, sync and fetch — composed from its parts: the
// state database (state_db), identity resolution (identity), the lease book and its session
// machine (lease_book), the pid watcher (pid_watch), the control plane (control_plane) and
// the data plane (data_plane). No control-plane or data-plane call, hash or fsync is made
// while the lease book's lock is held.
#pragma once
#include "mep/control_plane.hpp"
#include "mep/daemon_api.hpp"
#include "mep/data_plane.hpp"
#include "mep/identity.hpp"
#include "mep/file_locks.hpp"
#include "mep/lease_book.hpp"
#include "mep/peer.hpp"
#include "mep/pid_watch.hpp"
#include "mep/state_db.hpp"

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <sys/types.h>

namespace mep::daemon {

struct AttachRequest {
  std::string name; ///< display name
  std::filesystem::path path;
  std::int64_t ttl_s = lease::k_default_ttl_s;
  bool bind_pid = true;
  pid_t pid = 0;                      ///< the peer's pid (SO_PEERCRED)
  uid_t uid = static_cast<uid_t>(-1); ///< the peer's uid and gid: the lease's local owner
  gid_t gid = static_cast<gid_t>(-1);
  /// How long to wait for a held name or memory (0: fail fast with 423). Waits longer than
  /// the server's 300 s are several waits in a row.
  std::chrono::seconds wait{0};
  /// True once the agent that asked has gone: the wait ends (and leaves the server's queue).
  std::function<bool()> cancelled;
};

class Keeper {
public:
  /// Opens (creating) `state_dir`/mepd.db. `data_plane` may be null (no --store: sync and
  /// fetch answer 501, grants are not fenced). Throws std::runtime_error.
  Keeper(std::filesystem::path state_dir, std::unique_ptr<ControlPlane> cp,
         std::unique_ptr<DataPlane> data_plane = nullptr);
  /// Stops the threads; leases stay held on the server until their TTL (SIGTERM semantics).
  ~Keeper();

  /// Re-adopts persisted leases, resends pending claim intents, starts the threads.
  void start();

  // Requests from a local peer: `viewer` is its uid. A peer sees and acts on only the leases
  // it attached (root and the daemon's own user on all: may_act_on); another's is 404. File
  // calls run with the current peer's credentials (peer.hpp: AsPeer).

  /// Claims `name` for the file's memory; with a data plane, advances its fence before it
  /// answers (503 store-unavailable, and the lease given back, when it cannot). A peer that
  /// is not the daemon's own user must be able to open the file for writing itself (403).
  expected<Held, Problem> attach(const AttachRequest& req);
  /// Releases the lease under `name` (only the one with `lease_id`, when given).
  expected<void, Problem> detach(const std::string& name, const std::optional<std::string>& lease_id, uid_t viewer);
  std::vector<Held> list(uid_t viewer) const;
  expected<Held, Problem> get(const std::string& name, uid_t viewer) const;
  expected<BranchedFile, Problem> branch(const std::filesystem::path& path, const std::filesystem::path& new_path,
                                         uid_t viewer);
  expected<Identified, Problem> identify(const std::filesystem::path& path);
  expected<Initialized, Problem> init(const std::filesystem::path& path, mode_t mode);
  /// The lineage of the memory at `path`, or of the memory id `id`.
  expected<lease::Lineage, Problem> lineage(const std::optional<std::filesystem::path>& path, const std::string& id);
  /// Asks the control plane whether the lease under `name` is still the live one.
  expected<VerifiedLease, Problem> verify(const std::string& name, uid_t viewer);
  /// Uploads the lease's file to the data plane with its token; refused locally (nothing
  /// sent) when the lease is not live.
  expected<ObjectResult, Problem> sync(const std::string& name, uid_t viewer);
  /// Downloads the latest object of `memory_id` into the new file `path` (created with
  /// `mode`) and binds that file to the memory's identity.
  expected<ObjectResult, Problem> fetch(const std::string& memory_id, const std::filesystem::path& path, mode_t mode);

  boost::json::object health() const;
  std::string metrics() const;

  /// Registers an event sink (one NDJSON line per call, newline included) for the events of
  /// the leases `viewer` may see; returns its id.
  int subscribe(std::function<void(const std::string&)> sink, uid_t viewer);
  void unsubscribe(int id);

  const std::string& daemon_id() const { return m_state.daemon_id(); }

private:
  expected<Resolved, Problem> resolve_registered(const std::filesystem::path& path);
  std::optional<Problem> register_memory(const std::string& memory_id);
  expected<void, Problem> fence(const Held& h);
  void adopt(Held h, bool announce);
  void release_on_server(const Held& h);
  void forget(const std::vector<std::string>& names);
  void on_event(const Event& e);
  void on_process_exit(pid_t pid);
  void renew_loop();
  void renew_due();
  void deadline_loop();
  void fence_pending();
  void resend_intents();
  void pull_identity_map();
  FileLocks::Held lock_file(const std::filesystem::path& path);

  std::filesystem::path m_state_dir;
  StateDb m_state;
  Files m_files;
  IdentityResolver m_resolver{m_state, m_files};
  std::unique_ptr<ControlPlane> m_cp;
  std::unique_ptr<DataPlane> m_dp;
  LeaseBook m_book;
  PidWatcher m_pids;

  // Identity resolution and registration of one file at a time (by device and inode), so
  // two attaches of a new file do not mint two identities for it.
  FileLocks m_file_locks;

  mutable std::mutex m_sinks_mutex;
  struct Sink {
    std::function<void(const std::string&)> send;
    uid_t viewer;
  };
  std::map<int, Sink> m_sinks;
  int m_next_sink = 1;

  std::mutex m_stop_mutex;
  // Claim intents an attach is sending right now (it may wait for minutes): the renewer's
  // resend of pending intents leaves them to it.
  std::mutex m_attaching_mutex;
  std::set<std::string> m_attaching;
  std::condition_variable m_stop_cv;
  bool m_stop = false;
  std::thread m_renewer;
  std::thread m_deadline_watcher;

  // counters for /metrics
  std::atomic<long> m_batches{0}, m_batch_leases{0}, m_cp_requests{0}, m_lost{0}, m_grants{0}, m_state_errors{0};
};

} // namespace mep::daemon
