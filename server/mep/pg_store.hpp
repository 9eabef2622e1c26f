// The PostgreSQL implementation of Store (SPEC §9): a pool of connections, one thread
// each, every lease operation one call of a server-side function (one round trip, one
// transaction), retried on serialization failures and deadlocks. Claims go in batches: one
// call at a time, more (up to an eighth of the pool) only while a full batch waits or once
// a claim has waited 100 ms, each call carrying the claims queued when it starts (see
// m_claim_lanes).
#pragma once
#include "mep/clock_watch.hpp"
#include "mep/pg.hpp"
#include "mep/store.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace mep::server {

/// The schema version this mep writes on PostgreSQL (a newer database is refused).
int pg_schema_version();

class PgStore final : public Store {
public:
  /// Connects to `url`, creates or migrates the schema (safe when several servers start
  /// at once) and starts `options.pool` worker threads (connecting lazily). Throws
  /// pg::Error or std::runtime_error.
  PgStore(const std::string& url, const StoreOptions& options);
  void set_freed_listener(FreedListener f) override;
  void enter_queue(const Ctx&, QueuePlace, Then<std::uint64_t>) override;
  void leave_queue(std::uint64_t ticket) override;
  void mark_queue(std::uint64_t ticket, bool abandoned) override;
  void leave_all_queues() override;
  void refuse_queued(const Problem& why) override;
  /// Finishes every queued job, then stops the workers.
  ~PgStore() override;

  void register_memory(const Ctx&, Idempotency, RegisterMemory, Then<lease::Registered>) override;
  void claim(const Ctx&, Idempotency, Claim, Then<lease::Grant>) override;
  void branch(const Ctx&, Idempotency, Branch, Then<lease::Branched>) override;
  void renew(const Ctx&, LeaseRef, Then<lease::Renewed>) override;
  void renew_batch(const Ctx&, RenewBatch, Then<lease::RenewBatchResult>) override;
  void release(const Ctx&, LeaseRef, Then<Released>) override;
  void verify(const Ctx&, Verify, Then<lease::Verified>) override;
  void revoke(const Ctx&, Revoke, Then<Revoked>) override;
  void get_lease(const Ctx&, std::string canonical_name, Then<lease::LeaseInfo>) override;
  void list_leases(const Ctx&, ListLeases, Then<lease::LeasePage>) override;
  void get_memory(const Ctx&, std::string memory_id, Then<lease::Memory>) override;
  void lineage(const Ctx&, std::string memory_id, Then<lease::Lineage>) override;
  void history(const Ctx&, HistoryQuery, Then<lease::HistoryPage>) override;
  std::optional<AuthInfo> authenticate(const std::string& token_sha256) override;
  void audit_auth_failure(const std::string& tenant_id) override;
  bool ready() override;
  std::int64_t active_leases() override;
  std::vector<std::pair<std::string, std::int64_t>> active_leases_by_tenant() override;
  std::int64_t sweep() override;
  std::int64_t transaction_retries() override { return m_retries.load(); }
  std::int64_t clock_steps() override { return m_clock_steps.load(); }
  bool migration_in_progress() override { return m_migration_in_progress.load(); }
  void identity_map(const Ctx&, std::optional<std::string> cursor, std::size_t limit,
                    Then<lease::IdentityMapPage>) override;
  std::pair<std::string, std::string> create_token(const std::string& tenant_name, Scope) override;
  std::vector<TokenInfo> list_tokens(const std::optional<std::string>& tenant_name) override;
  bool revoke_token(const std::string& token_id) override;
  std::vector<AuditRow> list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) override;

private:
  // A job runs its call on a worker's connection and keeps the outcome; `done` hands it to
  // the caller, or hands over `failure` instead (no answer, a conflict retried too often).
  using Work = std::function<void(pg::Conn&)>;
  using Finish = std::function<void(std::optional<Problem> failure)>;
  struct ClaimCall;
  struct RefCall;
  /// The jobs that go in batches, each kind on lanes of its own (see m_claim_lanes).
  enum class Batch { none, claim, renew, release };
  struct Job {
    Work work;
    Finish done;
    std::string request_id;
    /// Whether running it twice is harmless, so that a call cut off with its outcome
    /// unknown may be sent again on a fresh connection: creating calls (replayed through
    /// their Idempotency-Key), renew and verify. Not release and revoke, whose second run
    /// could answer 409/404 for something that was done.
    bool repeatable = true;
    /// Set for a claim, which may be sent with others in one call (execute_batch); `work`
    /// sends it alone.
    std::shared_ptr<ClaimCall> claim;
    /// Set for a renewal or a release (`batch` says which), which may be sent with others
    /// of its kind in one call (execute_refs); `work` sends it alone.
    std::shared_ptr<RefCall> ref;
    Batch batch = Batch::none;
    std::chrono::steady_clock::time_point queued_at{}; ///< set by enqueue
  };
  // A connection slot: the connection (null while disconnected) and when to try again.
  struct Slot {
    std::unique_ptr<pg::Conn> conn;
    std::chrono::steady_clock::time_point next_attempt{};
  };
  // A connection borrowed for a synchronous call, returned on destruction.
  class Borrowed {
  public:
    Borrowed(PgStore* s, std::unique_ptr<pg::Conn> c) : m_store(s), m_conn(std::move(c)) {}
    Borrowed(Borrowed&&) = default;
    ~Borrowed();
    pg::Conn& operator*() { return *m_conn; }
    pg::Conn* operator->() { return m_conn.get(); }
    void discard() { m_conn.reset(); }

  private:
    PgStore* m_store;
    std::unique_ptr<pg::Conn> m_conn;
  };

  void migrate();
  void enqueue(Work work, Finish done, std::string request_id, bool repeatable = true);
  void enqueue(Job job);
  template <class T, class Op> // Op: Outcome<T>(pg::Conn&)
  void submit(Op op, Then<T> then, std::string request_id, bool repeatable = true);
  void worker_loop();
  std::optional<Problem> execute(Slot& slot, Job& job);
  /// Whether the slot has a usable connection, after opening one if it had none (not again
  /// within k_reconnect_gap of a failed attempt).
  bool connected(Slot& slot);
  /// Takes the next job this worker may run (under m_mutex): the first job that does not go
  /// in batches; or, while a lane of its kind is free, the first claim, renewal or release
  /// with every one of its kind queued behind it (up to k_claim_batch). False when there is
  /// none.
  bool take(std::vector<Job>& jobs);
  /// The calls of a kind running now (under m_mutex).
  int& running(Batch b);
  /// The jobs of a kind waiting in m_queue (under m_mutex).
  int& queued(Batch b);
  /// queued(b) changed: mep_pg_queued_operations{kind} follows it (under m_mutex).
  void publish_queued(Batch b);
  /// Hands `job` its outcome (`failure`, or none: its own); a throwing handler is logged.
  static void answer(Job& job, std::optional<Problem> failure);
  /// Whether a worker may start a call of a kind now, and why (under m_mutex).
  enum class Lane { closed, first, full_batch, waited };
  Lane lane_open(Batch b, std::chrono::steady_clock::time_point now);
  /// The longest-waiting job of a kind in m_queue, or null (under m_mutex).
  const Job* first_queued(Batch b) const;
  /// When the first job that waits for a lane while another could open will have waited
  /// k_lane_patience (under m_mutex); none when no job waits so.
  std::optional<std::chrono::steady_clock::time_point> lane_deadline();
  /// Sends claims in one call of mep_claim_batch, keeping each answer in its ClaimCall; when
  /// that fails, sends them one by one (execute), with the retries of a single claim.
  /// Returns each job's failure, as execute does.
  std::vector<std::optional<Problem>> execute_batch(Slot& slot, std::vector<Job>& jobs);
  /// Fills in what a claim's call takes when it is sent: the audit hashes (once) and a new
  /// event id (a run whose commit was not confirmed may have used the last one).
  void prepare_claim(pg::Conn& c, ClaimCall& call);
  /// Sends renewals in one call of mep_renew_many, or releases in one of mep_release_many,
  /// keeping each answer in its RefCall; when that fails before its commit, sends them one by
  /// one (execute). Returns each job's failure, as execute does.
  std::vector<std::optional<Problem>> execute_refs(Slot& slot, std::vector<Job>& jobs);
  /// Gives the lane of the batch `job` led back (takes m_mutex) and wakes an idle worker for
  /// queued jobs of its kind.
  void free_lane(const Job& job);
  /// Runs `fn` on a borrowed connection in the calling thread, with the same retry and
  /// reconnection rules as the workers (`repeatable` as for Job). Throws pg::Error when the
  /// database is unavailable.
  template <typename T>
  T with_conn(const std::function<T(pg::Conn&)>& fn, bool repeatable = true);
  std::unique_ptr<pg::Conn> connect();
  /// Runs a read on a borrowed connection in the calling thread and answers `done`: the
  /// reply, 400 for text PostgreSQL cannot hold, or 503 when the database is unavailable.
  template <class T>
  void read(const std::function<Outcome<T>(pg::Conn&)>& fn, const Then<T>& then);
  void backoff(int attempt) const;

  std::string m_url;
  StoreOptions m_options;
  std::vector<std::string> m_session_setup;

  // An idle worker, waiting to be handed the queue's next job (under m_mutex).
  struct Idle {
    std::condition_variable cv;
    bool woken = false;
  };

  std::mutex m_mutex;
  std::deque<Job> m_queue;
  std::optional<Problem> m_refusing; ///< refuse_queued: what every new job is answered (under m_mutex)
  std::vector<Idle*> m_idle;         // most recently idle last
  // Claims in flight at once, in batches: at most m_claim_lanes calls (an eighth of the pool,
  // at least one). On a 2-core database host, 16 backends each running one claim used about
  // 40 % more database CPU per claim than 4 (pgbench, the same function), and sent fewer
  // claims per second; a batch also shares its commit. Against 4 lanes (bench/ab_server.sh),
  // 2 used 24 % less database CPU per claim at 8 clients and 10 % less at 64, at the same
  // rate or better; 1 lane lost a fifth of the rate at 64 clients. Only the first lane is
  // always open: another opens while a full batch (k_claim_batch) waits, when one lane
  // cannot keep up however large its batches. Fewer, larger batches cost the database less
  // per claim: against both lanes open, 8 clients used a quarter less database CPU per claim
  // (0.310 -> 0.233 ms) at the same rate, and 64 clients a tenth less at 1.06x the rate;
  // renewals and releases gained alike (bench/ab_server.sh, 5 rounds). Claims queued while
  // no lane is open for them wait and go in the next batch.
  // A call blocked in the database (on a row lock held elsewhere, on a slow backend) would
  // hold the claims queued behind it: after k_lane_patience of waiting they take another
  // lane, and an idle worker stands by to see to it (m_standby).
  // Single renewals and releases go the same way, each on as many lanes of their own: each
  // alone is a transaction and a commit, and at 8 clients or more most of its database CPU.
  static constexpr std::size_t k_claim_batch = 32; // jobs in one batch, of any kind
  static constexpr std::chrono::milliseconds k_lane_patience{100};
  int m_claim_lanes = 1;
  int m_claims_running = 0;
  int m_renewals_running = 0;
  int m_releases_running = 0;
  int m_claims_queued = 0;
  int m_renewals_queued = 0;
  int m_releases_queued = 0;
  bool m_standby = false; // an idle worker waits for a lane_deadline
  bool m_stopping = false;
  std::vector<std::thread> m_workers;
  // LISTEN mep_lease_freed: releases and revocations through any server wake waiters here.
  // LISTEN mep_tokens: a token revoked through any process drops the cache below.
  void listen_loop();
  std::mutex m_listener_mutex;
  FreedListener m_listener;
  std::thread m_listen_thread;
  int m_listen_wake = -1; // eventfd: stop

  // This server's tickets in the queue of waiting claims: renewed by the listener every
  // k_wait_beat; each counts until k_wait_alive after its last renewal.
  static constexpr std::chrono::milliseconds k_wait_beat{1000};
  static constexpr std::chrono::milliseconds k_wait_alive{5000};
  std::string live_tickets(); // as a PostgreSQL array literal; empty when none
  std::mutex m_tickets_mutex;
  std::set<std::uint64_t> m_tickets;

  std::mutex m_spare_mutex;
  std::vector<std::unique_ptr<pg::Conn>> m_spare; // for synchronous calls
  std::atomic<std::int64_t> m_next_sync_attempt_ns{0};

  // Verified tokens, kept at most k_auth_lifetime and only while the listener hears
  // mep_tokens (m_listen_fd ≥ 0): a hit saves the authentication's round trip. A revocation
  // (mep_tokens) or a listener that lost its connection drops them all (m_auth_gen moves on:
  // a lookup that began before does not store its result).
  static constexpr std::chrono::milliseconds k_auth_lifetime{1000};
  static constexpr std::size_t k_auth_capacity = 4096;
  void drop_auth_cache();
  std::mutex m_auth_mutex;
  std::unordered_map<std::string, std::pair<AuthInfo, std::chrono::steady_clock::time_point>> m_auth_cache;
  std::atomic<std::uint64_t> m_auth_gen{0};
  std::atomic<int> m_listen_fd{-1};
  /// The listener's socket is set and cleared under this, and shut down under it when the
  /// store closes: a statement blocked on a database that does not answer (frozen, cut
  /// off) then fails at once, rather than hold up the exit until the client-side timeout.
  std::mutex m_listen_fd_mutex;
  bool m_listen_closing = false; // under m_listen_fd_mutex

  std::atomic<bool> m_healthy{true};
  std::atomic<bool> m_migration_in_progress{false};
  std::chrono::steady_clock::time_point m_next_sweep; // sweeper thread only: see sweep_spacing
  std::atomic<std::int64_t> m_retries{0};

  // The database clock, read every k_wait_beat by the listener against this process's boot
  // clock (schema v6): steps found are recorded in mep_clock_steps and counted here; claims
  // and sweeps carry the bound it sets.
  void watch_clock(pg::Conn& c);
  pg::Param clock_bound() const;
  ClockWatch m_clock;
  std::atomic<std::int64_t> m_clock_steps{0};

  // Each tenant's audit salt, read once (a salt never changes): the server computes a
  // claim's audit hashes (schema v7).
  std::optional<std::string> audit_salt(pg::Conn& c, const std::string& tenant_id);
  std::mutex m_salt_mutex;
  std::unordered_map<std::string, std::string> m_salts;
};

} // namespace mep::server
