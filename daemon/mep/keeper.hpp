// The lease keeper: what mepd does for its agents (SPEC §7, §8) — attach and detach,
// branch, identify, init, lineage, verify, sync and fetch — composed from its parts: the
// state database (state_db), identity resolution (identity), the lease book and its session
// machine (lease_book), the pid watcher (pid_watch), the control plane (control_plane) and
// the data plane (data_plane). No control-plane or data-plane call, hash or fsync is made
// while the lease book's lock is held.
#pragma once
#include "mep/control_plane.hpp"
#include "mep/daemon_api.hpp"
#include "mep/daemon_service.hpp"
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

class Keeper final : public DaemonService {
public:
  /// Opens (creating) `state_dir`/mepd.db. `data_plane` may be null (no --store: sync and
  /// fetch answer 501, grants are not fenced). Throws std::runtime_error.
  Keeper(std::filesystem::path state_dir, std::unique_ptr<ControlPlane> cp,
         std::unique_ptr<DataPlane> data_plane = nullptr);
  /// Stops the threads; leases stay held on the server until their TTL (SIGTERM semantics).
  ~Keeper() override;

  /// Re-adopts persisted leases, resends pending claim intents, starts the threads.
  void start();

  // DaemonService (daemon_service.hpp says what each does).
  expected<Held, Problem> attach(const AttachRequest& req) override;
  expected<Detached, Problem> detach(const std::string& name, const std::optional<std::string>& lease_id,
                                     uid_t viewer) override;
  std::vector<Held> list(uid_t viewer) const override;
  expected<Held, Problem> get(const std::string& name, uid_t viewer) const override;
  expected<BranchedFile, Problem> branch(const std::filesystem::path& path, const std::filesystem::path& new_path,
                                         uid_t viewer, mode_t mode) override;
  expected<Identified, Problem> identify(const std::filesystem::path& path) override;
  expected<Initialized, Problem> init(const std::filesystem::path& path, mode_t mode) override;
  expected<lease::Lineage, Problem> lineage(const std::optional<std::filesystem::path>& path,
                                            const std::string& id) override;
  expected<VerifiedLease, Problem> verify(const std::string& name, const std::optional<std::string>& lease_id,
                                          uid_t viewer) override;
  expected<ObjectResult, Problem> sync(const std::string& name, const std::optional<std::string>& lease_id,
                                       uid_t viewer) override;
  expected<ObjectResult, Problem> fetch(const std::string& memory_id, const std::filesystem::path& path,
                                        mode_t mode) override;
  boost::json::object health() const override;
  std::string metrics() const override;
  int subscribe(std::function<void(const std::string&)> sink, uid_t viewer) override;
  void unsubscribe(int id) override;

  const std::string& daemon_id() const { return m_state.daemon_id(); }
  /// mepd --anonymous-holder: claims tell the control plane nothing of who holds them (no
  /// host name, pid, executable or labels). Set before start().
  void set_anonymous_holder(bool on) { m_anonymous_holder = on; }

private:
  std::optional<lease::Holder> holder_of(const AttachRequest& req) const;
  expected<Resolved, Problem> resolve_registered(const std::filesystem::path& path);
  std::optional<Problem> register_memory(const std::string& memory_id);
  expected<void, Problem> fence(const Held& h);
  /// Keeps `h`: saved for re-adoption (unless `save` is false: saved already), with
  /// `finished_intent` deleted in the same write; in the book; its agent watched.
  void adopt(Held h, bool announce, const std::string& finished_intent = {}, bool save = true);
  /// False when the outcome is unknown (the control plane was not reached, or did not answer).
  /// `refused`, when given, gets the control plane's answer unless it confirmed the release.
  bool release_on_server(const Held& h, std::optional<Problem>* refused = nullptr);
  /// Ends a lease taken from the book (a detach, its agent's exit): see keeper_attach.cpp. Returns
  /// why the control plane did not confirm the release, when it did not.
  std::optional<Problem> end_taken(const Held& h);
  /// Deletes the records of leases that ended (lazily: see StateDb::forget_lease).
  void forget(const std::vector<Ended>& ended);
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
  bool m_anonymous_holder = false;
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
  // Claim intents whose outcome an attach learned but could not write down (the state
  // database refused the write): `settled`, the agent was answered and the intent only has
  // to go (resending it would replay a grant the agent may have released since, and adopt
  // it again); `orphaned`, the outcome stayed unknown and the agent was told it failed, so
  // a grant the resend finds is released, as for an intent marked so on disk. Under
  // m_attaching_mutex; kept until the intent's row is gone.
  enum class IntentFate { settled, orphaned };
  std::map<std::string, IntentFate> m_intent_fates;
  void remember_fate(const std::string& key, IntentFate fate);
  std::condition_variable m_stop_cv;
  bool m_stop = false;
  std::thread m_renewer;
  std::thread m_deadline_watcher;

  // counters for /metrics
  std::atomic<long> m_batches{0}, m_batch_leases{0}, m_cp_requests{0}, m_lost{0}, m_grants{0}, m_state_errors{0};
  /// The renewer's: the control plane refuses the daemon's token (logged once per run of refusals).
  bool m_token_refused = false;
};

} // namespace mep::daemon
