// The SQLite implementation of Store: embedded, one process, group commit.
#pragma once
#include "mep/crypto.hpp"
#include "mep/lease_rules.hpp"
#include "mep/renewal_table.hpp"
#include "mep/sqlite.hpp"
#include "mep/store.hpp"
#include "mep/token_cache.hpp"
#include "mep/rows.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace mep::server {

/// The schema version this mep writes on SQLite (a newer database is refused).
int sqlite_schema_version();

/// Takes the lock file DB_PATH + `suffix` (flock: held while the descriptor is open, dropped
/// by the kernel however the process ends), creating the database's directory (0700) when
/// missing. The open descriptor, or -1 when another process holds the lock; throws on any
/// other failure.
int try_lock_beside(const std::string& db_path, std::string_view suffix);

class SqliteStore final : public Store {
public:
  /// Opens (creating and migrating) the database at `url` (`sqlite:PATH` or a path) and
  /// starts the writer thread. Throws sqlite::Error or std::runtime_error.
  /// `create`: false refuses a database file that does not exist yet.
  /// `writer_nice`: see StoreOptions::writer_nice.
  /// `serving`: this process serves the database (mep server, mepd's embedded control
  /// plane): it takes PATH-serving.lock, and a second serving process is refused.
  /// `wal_writer_frames`: the log's length (in pages) at which the writer checkpoints it
  /// itself, between transactions, when the checkpointer thread could not (see
  /// on_wal_commit); at least 1,000.
  explicit SqliteStore(const std::string& url, bool create = true, int writer_nice = 0, bool serving = false,
                       int wal_writer_frames = 32000);
  /// Finishes every queued job, then stops the writer.
  ~SqliteStore() override;

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
  bool migration_in_progress() override;
  void set_completion_executor(CompletionExecutor executor) override { m_complete = std::move(executor); }
  void refuse_queued(const Problem& why) override;
  /// One process serves the database, so the queue of waiting claims is that process's:
  /// a ticket is a counter, and the claim carries how many wait ahead of it.
  void enter_queue(const Ctx&, QueuePlace, Then<std::uint64_t> then) override { then(++m_last_ticket); }
  void identity_map(const Ctx&, std::optional<std::string> cursor, std::size_t limit,
                    Then<lease::IdentityMapPage>) override;
  /// The database file (for tools that work on it directly, such as mep migrate).
  const std::string& path() const { return m_path; }
  std::pair<std::string, std::string> create_token(const std::string& tenant_name, Scope) override;
  std::vector<TokenInfo> list_tokens(const std::optional<std::string>& tenant_name) override;
  bool revoke_token(const std::string& token_id) override;
  std::vector<AuditRow> list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) override;

private:
  // A job runs its operation on the writer thread and keeps the outcome; `done` hands it
  // to the caller after the COMMIT, or hands over `failure` instead (the job threw, or the
  // commit failed: nothing of it is on disk).
  using Work = std::function<void(sqlite::Db&, UnixMs)>;
  using Finish = std::function<void(std::optional<Problem> failure)>;
  struct Job {
    Work work;
    Finish done;
    std::string request_id;
    bool careful = false; // its work must not run twice (run_sync): savepoints from the start
    bool lazy = false;    // a renewal: may be answered before it is on disk (see run_batch)
  };
  struct PendingAudit {
    std::string tenant_id;
    std::string type;
    std::string name;
    std::string memory_id;
    std::optional<std::int64_t> token;
    std::optional<std::int64_t> renewals;
  };
  // A read-only connection borrowed from the pool, returned on destruction.
  class ReaderLease {
  public:
    ReaderLease(SqliteStore* s, std::unique_ptr<sqlite::Db> db) : m_store(s), m_db(std::move(db)) {}
    ReaderLease(ReaderLease&&) = default;
    ~ReaderLease();
    sqlite::Db& db() { return *m_db; }

  private:
    SqliteStore* m_store;
    std::unique_ptr<sqlite::Db> m_db;
  };

  void migrate();
  void refresh_migration_state(sqlite::Db& db);
  void enqueue(Work work, Finish done, std::string request_id = {}, bool careful = false, bool lazy = false);
  /// Queues an operation whose outcome goes to `then`.
  template <class T, class Op> // Op: Outcome<T>(sqlite::Db&, UnixMs)
  void submit(Op op, Then<T> then, std::string request_id, bool lazy = false);
  /// Runs a read on a pooled read-only connection in the calling thread and answers `then`
  /// (503 when the database cannot be read).
  template <class T>
  void read(const std::function<Outcome<T>(sqlite::Db&, UnixMs)>& op, const Then<T>& then);
  void writer_loop();
  /// The WAL checkpoints (see the notes in server/sqlite/store.cpp): on_wal_commit runs on the
  /// writer after each commit; checkpoint_loop is the checkpointer thread.
  static int on_wal_commit(void* self, sqlite3* db, const char* schema, int frames);
  void checkpoint_loop();
  void run_batch(std::vector<Job>& batch);
  void sync_wal();
  enum class Pass { done, run_carefully, aborted };
  /// Runs the batch's jobs inside the open transaction. Careful: each job in a SAVEPOINT.
  /// Optimistic: none, and run_carefully when a job needs its writes undone (it threw, or
  /// an idempotent operation failed, after writing). aborted: SQLite ended the
  /// transaction itself (disk full, I/O error), so no job's writes are left.
  /// Jobs from index `from` on.
  Pass run_jobs(std::vector<Job>& batch, std::vector<std::optional<Problem>>& failures, bool careful,
                std::size_t from = 0);
  /// Moves requests that are waiting into the open batch (see run_batch); their count.
  std::size_t extend_batch(std::vector<Job>& batch, bool careful, bool lazy,
                           std::chrono::steady_clock::time_point began);
  template <typename T>
  T run_sync(std::function<T(sqlite::Db&, UnixMs)> fn);
  ReaderLease reader();

  /// `record_refusal` false: a 423 outcome is not recorded (Claim::record_refusal).
  /// The operation runs unless an outcome is stored under the key; its outcome is stored
  /// (as the body the HTTP API answers, rendered by lease/wire.hpp) unless it is a 5xx.
  template <class T>
  Outcome<T> run_idempotent(sqlite::Db& db, UnixMs now, const Ctx& ctx, const Idempotency& idem,
                            const std::function<expected<T, Problem>()>& op, bool record_refusal = true);
  expected<LeaseRow, Problem> classify(sqlite::Db& db, UnixMs now, const Ctx& ctx, const std::string& memory_id,
                                       std::int64_t token, Code not_found);
  expected<lease::Grant, Problem> op_claim(sqlite::Db& db, UnixMs now, const Ctx& ctx, const Claim& req);
  expected<lease::Renewed, Problem> op_renew(sqlite::Db& db, UnixMs now, const Ctx& ctx, const LeaseRef& ref);
  /// The renewal answered from memory, when it can be (see "Renewals from memory").
  std::optional<lease::Renewed> renew_from_memory(const Ctx& ctx, const LeaseRef& ref);
  /// Writer: takes the lease of `row` out of m_renewals before the writer acts on the row;
  /// a later expiry a renewal from memory gave it goes into `row` and the database.
  void settle(sqlite::Db& db, LeaseRow& row);
  /// Readers: a later expiry that a renewal from memory gave `row`'s lease.
  void overlay(LeaseRow& row) const;
  /// Writer: writes what m_renewals has not told the database yet (run_batch).
  void flush_renewals(sqlite::Db& db);
  /// Writer, when the store stops: the last flush, synced, and the serving mark removed.
  void stop_serving();

  // Audit rows are collected while a job runs and written after its savepoint is
  // resolved, so rejected requests (stale fences, name conflicts) are audited too.
  void audit(const std::string& tenant_id, std::string_view type, std::string_view name, std::string_view memory_id,
             std::optional<std::int64_t> token, std::optional<std::int64_t> renewals = std::nullopt);
  void audit(const rules::AuditNote& note) {
    audit(note.tenant_id, note.type, note.name, note.memory_id, note.token, note.renewals);
  }
  /// Sets m_clock from the saved checkpoint (see the lease clock's notes in server/sqlite/store.cpp).
  void anchor_clock();
  /// Saves `at` (a lease-clock reading and CLOCK_BOOTTIME then) as the clock's checkpoint.
  void save_clock_checkpoint(sqlite::Db& db, std::pair<UnixMs, std::int64_t> at);
  void write_pending_audit();
  /// The tenant's audit HMAC, keyed by its salt (read once per tenant).
  const HmacSha256& audit_mac(sqlite::Db& db, const std::string& tenant_id);

  std::string m_path;
  LeaseClock m_clock;                             // decides expiry (see anchor_clock); set before the writer starts
  int m_serving_lock = -1;                        // flock held while this process serves the database
  std::unique_ptr<sqlite::Db> m_db;               // the writer's connection; writer thread only after start
  std::vector<PendingAudit> m_pending_audit;      // writer thread only
  bool m_careful = false;                         // writer thread only: run_jobs' mode
  std::optional<int> m_own_nice;                  // writer thread only: its nice before writer_nice
  bool m_nice_switch = false;                     // writer thread only: it may go back to m_own_nice
  bool m_lazy_commits = false;                    // writer thread only: synchronous=NORMAL is set
  bool m_must_sync = false;                       // writer thread only: this lazy batch is synced after all
  int m_wal_frames = 0;                           // writer thread only: the log's length after the last commit
  int m_wal_asked = 0;                            // writer thread only: its length when the checkpointer was woken
  int m_wal_retry_at = 0;                         // writer thread only: no checkpoint of its own below this length
  int m_wal_writer_frames;                        // its own checkpoint after commits that were not synced
  std::map<std::string, HmacSha256> m_audit_macs; // writer thread only
  bool m_serving = false;                         // this process serves the database (see the constructor)
  RenewalTable m_renewals;                        // renewals answered from memory (serving only)
  std::pair<UnixMs, std::int64_t> m_flushed_at{}; // writer thread only: clock and boot time of the last flush

  std::mutex m_mutex;
  std::condition_variable m_cv;
  std::deque<Job> m_queue;
  bool m_flush_wanted = false; // under m_mutex: m_renewals has renewals the database was not told
  bool m_stopping = false;
  std::optional<Problem> m_refusing; // refuse_queued: what every new job is answered (under m_mutex)
  std::atomic<bool> m_healthy{true};
  std::atomic<bool> m_migration_in_progress{false};
  std::thread m_writer;
  int m_writer_nice = 0;

  std::unique_ptr<sqlite::Db> m_checkpoint_db; // the checkpointer's connection
  std::mutex m_checkpoint_mutex;
  std::condition_variable m_checkpoint_cv;
  bool m_checkpoint_wanted = false; // under m_checkpoint_mutex
  bool m_checkpoint_stopping = false;
  std::thread m_checkpointer;
  CompletionExecutor m_complete; // set before the first operation, read by the writer
  std::atomic<std::uint64_t> m_last_ticket{0};

  TokenCache m_tokens; // after m_path

  std::mutex m_readers_mutex;
  std::vector<std::unique_ptr<sqlite::Db>> m_readers;
};

} // namespace mep::server
