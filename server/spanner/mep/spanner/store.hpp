// The Cloud Spanner implementation of Store (issue 51): global mutual exclusion on the
// engine the design report recommends. Each lease operation is one read-write transaction
// of two REST calls (one statement that begins the transaction and reads everything the
// rules need, then a commit carrying mutations), decided in C++ by the rules the SQLite
// store uses (lease_rules.hpp). Expiry is judged on Spanner's clock: every transaction reads
// CURRENT_TIMESTAMP() first and decides with it; no server's wall clock decides a lease.
//
// Design notes.
// * Transactions: run_rw() runs a body on one session; ABORTED (the transaction lost a lock
//   conflict, on production Spanner or against another server on the emulator) is retried on
//   the same session, with full-jitter backoff capped at 100 ms, for at most
//   k_tx_budget, then answered 503 transaction-conflict; each retry is counted in
//   mep_db_transaction_retries_total. Any other failure rolls the transaction back before
//   anything else happens to the session (a session deleted with an open transaction wedges
//   the emulator).
// * A commit whose outcome is unknown (no answer) is run again only for operations whose
//   second run is harmless: claims, branches and registrations carry their Idempotency-Key
//   (the record is written in the same commit, so a second run replays it); renewals extend
//   an expiry by the same rule; a release that committed finds its lease ended and answers
//   204 again. A revocation's unknown outcome is answered 503.
// * Sessions: one per worker thread (the pool), one more per caller of a synchronous read
//   (authenticate, readiness); recreated on NOT_FOUND; kept alive by use (a worker idle for
//   45 min runs SELECT 1); rolled back (never left open) before they are deleted at exit.
// * Emulator mode (an http:// endpoint): the emulator runs one read-write transaction per
//   database and aborts the others, so this process runs one at a time (m_rw_gate); the
//   retry loop stays, since two servers still abort each other.
// * Keys spread writes over splits: a memory's rows are keyed by spread_key(id) (8 hex of its
//   SHA-256, then the id) rather than by the time-ordered UUIDv7; names, skeletons, tenants
//   and token hashes are spread by nature.
// * Waiting claims (Prefer: wait): a ticket is a row of `waiters`, ordered by its commit
//   timestamp (TrueTime: a waiter that entered after another committed has a later one) and
//   its random id; a claim's read counts the live tickets ahead of it. A release or a
//   revocation also writes a row of `lease_frees`; every server polls that table every
//   k_free_poll (one strong read) and wakes its waiters, where PostgreSQL uses NOTIFY.
#pragma once
#include "mep/crypto.hpp"
#include "mep/spanner/auth.hpp"
#include "mep/spanner/rest.hpp"
#include "mep/store.hpp"

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
#include <thread>
#include <vector>

namespace mep::server::spanner {

/// How long one operation may spend retrying aborted transactions before 503.
inline constexpr std::chrono::milliseconds k_tx_budget{10'000};
/// How often each server reads the leases other servers freed (for its waiting claims).
inline constexpr std::chrono::milliseconds k_free_poll{250};

/// A database URL: spanner:projects/P/instances/I/databases/D[?endpoint=URL].
struct Location {
  std::string database; ///< projects/P/instances/I/databases/D
  std::string endpoint; ///< https://spanner.googleapis.com, or the emulator's http://HOST:PORT
};
/// The database and endpoint of a spanner: URL: the URL's `endpoint` parameter, else
/// $MEP_SPANNER_ENDPOINT, else https://spanner.googleapis.com. An error says what is wrong
/// (never repeating the URL).
expected<Location, std::string> parse_location(const std::string& url);

/// The key a memory's rows are stored under (see the design notes).
std::string spread_key(std::string_view id);

/// The schema version this mep writes on Spanner.
int schema_version();

class SpannerStore final : public Store {
public:
  /// Connects, creates or migrates the schema (DDL), and starts the workers. Throws
  /// std::runtime_error with a readable message (the database missing, a newer schema,
  /// foreign tables of mep's names, no credentials).
  SpannerStore(const std::string& url, const StoreOptions& options);
  ~SpannerStore() override;

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
  void refuse_queued(const Problem& why) override;
  void set_freed_listener(FreedListener listener) override;
  void enter_queue(const Ctx&, QueuePlace, Then<std::uint64_t>) override;
  void leave_queue(std::uint64_t ticket) override;
  void mark_queue(std::uint64_t ticket, bool abandoned) override;
  void leave_all_queues() override;
  std::int64_t transaction_retries() override { return m_retries.load(); }
  bool migration_in_progress() override { return m_migration_in_progress.load(); }
  void identity_map(const Ctx&, std::optional<std::string> cursor, std::size_t limit,
                    Then<lease::IdentityMapPage>) override;
  std::pair<std::string, std::string> create_token(const std::string& tenant_name, Scope) override;
  std::vector<TokenInfo> list_tokens(const std::optional<std::string>& tenant_name) override;
  bool revoke_token(const std::string& token_id) override;
  std::vector<AuditRow> list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) override;

  /// The REST client (for mep migrate and tests).
  Rest& rest() { return *m_rest; }
  /// Runs `f` on one of the store's sessions (mep migrate's reads and transactions).
  void with_session(const std::function<void(std::string& session)>& f);

  // ---- the transaction machinery (transactions.cpp), used by the operations -------------------

  /// One attempt's view of a read-write transaction: its first statement begins it.
  class Tx {
  public:
    Tx(Rest& rest, std::string& session) : m_rest(rest), m_session(session) {}
    /// Runs a statement in the transaction (the first one begins it inline).
    Rpc<boost::json::object> query(std::string_view sql, const Params& params = {});
    /// Reads `columns` of the rows of `table` whose primary keys are `keys` (each key a
    /// JSON array of its parts), in the transaction (the first call begins it inline).
    Rpc<boost::json::object> read(std::string_view table, const std::vector<std::string>& columns,
                                  boost::json::array keys);
    const std::string& id() const { return m_id; }

  private:
    // The transaction selector for the next call; the id from its answer when it begins one.
    boost::json::object selector() const;
    Rpc<boost::json::object> begun(Rpc<boost::json::object> r);
    Rest& m_rest;
    std::string& m_session;
    std::string m_id;
    int m_seqno = 0;
  };

  /// What a transaction body decided: the mutations to commit (none: roll back) and a
  /// function that makes the outcome once the commit is known to have happened.
  struct Decision {
    Mutations mutations;
    std::function<void()> after_commit; ///< counts metrics, etc.; may be empty
    bool wrote = false;                 ///< DML ran in the transaction: commit even without mutations
  };
  /// Whether a commit whose outcome is unknown may be run again (see the design notes).
  enum class Repeat { safe, unsafe };
  /// Runs `body` in read-write transactions until one commits or the budget is spent;
  /// the problem to answer otherwise (503 transaction-conflict or unavailable).
  std::optional<Problem> run_rw(std::string& session, Repeat repeat, const std::function<Rpc<Decision>(Tx&)>& body);
  /// One statement in a single-use strong read-only transaction on `session`.
  Rpc<boost::json::object> read_once(std::string& session, std::string_view sql, const Params& params = {});
  /// A blind write (a single-use read-write transaction): audit rows that go with a read.
  Rpc<void> write_once(std::string& session, const Mutations& mutations);

private:
  struct Job {
    std::function<void(std::string& session)> work; // runs on a worker, with its session
    std::function<void(const Problem&)> refuse;     // answers it unrun (shutdown)
  };
  template <class T>
  void submit(std::function<Outcome<T>(std::string& session)> op, Then<T> then);
  void worker_loop();
  void poll_loop();
  std::string borrow_session();
  void return_session(std::string session);
  /// A fresh session; throws std::runtime_error when Spanner cannot be reached.
  std::string new_session();
  void migrate();
  /// The tenant's audit HMAC key (its salt), read once per tenant; outside any transaction
  /// of `session` (a session runs one transaction at a time).
  std::string audit_salt(std::string& session, const std::string& tenant_id);
  /// The salts of `tenants` not known yet, read in the transaction.
  Rpc<void> load_salts(Tx& tx, const std::vector<std::string>& tenants);
  /// An audit row as a mutation (its hashes made with the tenant's salt, loaded before).
  void add_audit(Mutations& m, const std::string& tenant_id, std::string_view type, std::string_view name,
                 std::string_view memory_id, std::optional<std::int64_t> token, UnixMs at,
                 std::optional<std::int64_t> renewals = std::nullopt);
  /// Renewals of `refs` in one transaction, each decided on its own, in order.
  Outcome<std::vector<expected<lease::Renewed, Problem>>> renew_all(std::string& session, const Ctx& ctx,
                                                                    const std::vector<LeaseRef>& refs);

  std::unique_ptr<Transport> m_transport;
  std::unique_ptr<TokenSource> m_tokens;
  std::unique_ptr<Rest> m_rest;
  bool m_serialize = false; // emulator mode: one read-write transaction at a time
  std::mutex m_rw_gate;     // held for a whole transaction in emulator mode
  std::atomic<std::int64_t> m_retries{0};
  std::atomic<bool> m_migration_in_progress{false};
  std::chrono::steady_clock::time_point m_next_sweep{};

  std::mutex m_mutex;                // guards the queue, the spare sessions and the flags below
  std::condition_variable m_cv;      // the workers': a job queued, or stopping
  std::condition_variable m_poll_cv; // the poller's: stopping (a cv of its own, so no job's wake-up is lost to it)
  std::deque<Job> m_queue;
  std::vector<std::string> m_spare; // sessions for synchronous calls
  bool m_stopping = false;
  std::optional<Problem> m_refusing;
  std::vector<std::thread> m_workers;
  std::vector<std::string> m_worker_sessions; // to delete at exit

  std::mutex m_salts_mutex;
  std::map<std::string, std::string> m_salts;

  // Tokens seen valid in the last second (authenticate): SHA-256 → (auth, when).
  std::mutex m_auth_mutex;
  std::map<std::string, std::pair<AuthInfo, std::chrono::steady_clock::time_point>> m_auth_cache;

  // The queue of waiting claims: this server's tickets, and the freed-lease poller.
  struct Ticket {
    std::int64_t waiter_id = 0;
    std::string entered_at; // its commit timestamp
  };
  std::mutex m_tickets_mutex;
  std::map<std::uint64_t, Ticket> m_tickets;
  std::uint64_t m_last_ticket = 0;
  std::mutex m_listener_mutex;
  FreedListener m_listener;
  std::thread m_poller;
  std::string m_poll_after; // the commit timestamp of the last free read (poller thread only)
};

} // namespace mep::server::spanner
