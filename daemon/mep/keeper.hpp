// The lease keeper: everything mepd knows and does (SPEC §7) — the path map, attaching
// and releasing, renewals in batches, local deadlines, loss, pid watches, events, and
// the persistence that lets a restarted daemon re-adopt its leases.
#pragma once
#include "mep/control_plane.hpp"
#include "mep/sqlite.hpp"
#include "mep/store.hpp"

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <sys/types.h>

namespace mep::daemon {

using SteadyTime = std::chrono::steady_clock::time_point;

struct AttachRequest {
  std::string name; ///< display name
  std::filesystem::path path;
  std::int64_t ttl_s = server::k_default_ttl_s;
  bool bind_pid = true;
  pid_t pid = 0; ///< the peer's pid (SO_PEERCRED)
};

/// One lease this daemon holds for a local agent.
struct Held {
  std::string canonical_name;
  std::string display_name;
  std::string memory_id;
  std::string lease_id;
  std::string owner_client_id;
  std::int64_t fencing_token = 0;
  std::int64_t ttl_s = 0;
  UnixMs expires_at = 0; ///< the server's expiry (wall clock)
  std::string path;
  pid_t bind_pid = 0;   ///< 0: not bound
  std::string state;    ///< held | degraded | lost
  std::string lost_reason;
  SteadyTime local_deadline{};
  SteadyTime next_renew{};
  int failures = 0;
};

class Keeper {
public:
  /// Opens (creating) `state_dir`/mepd.db. Throws std::runtime_error.
  Keeper(std::filesystem::path state_dir, std::unique_ptr<ControlPlane> cp);
  /// Stops the threads; leases stay held on the server until their TTL (SIGTERM semantics).
  ~Keeper();

  /// Re-adopts persisted leases, resends pending claim intents, starts the threads.
  void start();

  server::Reply attach(const AttachRequest& req, const std::string& rid);
  server::Reply detach(const std::string& name, const std::string& rid);
  server::Reply list(const std::string& rid);
  server::Reply get(const std::string& name, const std::string& rid);
  server::Reply branch(const std::filesystem::path& path, const std::filesystem::path& new_path, const std::string& rid);
  server::Reply identify(const std::filesystem::path& path, const std::string& rid);
  server::Reply init(const std::filesystem::path& path, mode_t mode, const std::string& rid);
  /// The lineage of the memory at `path`, or of the memory id `id` (ancestors and children).
  server::Reply lineage(const std::optional<std::filesystem::path>& path, const std::string& id, const std::string& rid);
  boost::json::object health();
  std::string metrics();

  /// Registers an event sink (one NDJSON line per call, newline included); returns its id.
  int subscribe(std::function<void(const std::string&)> sink);
  void unsubscribe(int id);

  const std::string& daemon_id() const { return m_daemon_id; }

private:
  struct Identity {
    std::string memory_id;
    bool fresh = false;
  };
  expected<Identity, Problem> resolve(const std::filesystem::path& path, bool register_unknown);
  void remember_file(const std::string& memory_id, const std::filesystem::path& path, bool with_hash);
  bool knows_memory(const std::string& memory_id);
  std::optional<Problem> register_memory(const std::string& memory_id);
  boost::json::object lease_json(const Held& h) const;
  void persist(const Held& h);
  void forget(const std::string& canonical_name);
  void emit(std::string_view event, const Held& h, std::string_view code = {});
  void mark_lost(Held& h, std::string_view reason);
  void release_on_server(const Held& h);
  void watch_pid(pid_t pid);
  void renew_loop();
  void renew_due();
  void deadline_loop();
  void pid_loop();
  void resend_intents();
  void pull_identity_map();
  std::chrono::milliseconds margin(std::int64_t ttl_s) const;
  void note_times(const Held& h);
  Held held_from_grant(const boost::json::object& o, std::string owner, std::string path, pid_t pid,
                       SteadyTime sent) const;
  void recompute_checks();

  std::filesystem::path m_state_dir;
  std::unique_ptr<ControlPlane> m_cp;
  std::string m_daemon_id;

  std::mutex m_mutex; // guards everything below and m_db
  std::unique_ptr<sqlite::Db> m_db;
  std::map<std::string, Held> m_leases; // by canonical name
  std::map<pid_t, int> m_pidfds;        // watched pid -> pidfd
  SteadyTime m_next_renew_check{};      // no lease is due before this (renewer skips scans)
  SteadyTime m_next_deadline_check{};   // no deadline passes before this
  std::map<int, std::function<void(const std::string&)>> m_sinks;
  int m_next_sink = 1;
  bool m_stop = false;
  std::condition_variable m_cv;
  std::thread m_renewer;
  std::thread m_deadline_watcher;
  std::thread m_pid_watcher;
  int m_wake_fd = -1; // eventfd waking the pid watcher

  // counters for /metrics
  long m_batches = 0, m_batch_leases = 0, m_cp_requests = 0, m_lost = 0, m_grants = 0;
};

} // namespace mep::daemon
