// The control plane's storage interface (SPEC §6, §9). Every lease operation is one
// whole transaction behind it; the SQLite and PostgreSQL backends implement it, and the
// LeaseService (lease_service.hpp) calls it for the HTTP router and for the daemon's
// embedded mode. Requests and results are the typed operations of lease/types.hpp. No SQL
// outside a store.
#pragma once
#include "mep/canonical.hpp"
#include "mep/expected.hpp"
#include "mep/lease/types.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mep::server {

/// Who is calling: the tenant and scopes of a verified bearer token.
struct AuthInfo {
  std::string tenant_id;
  std::string token_id;
  bool scope_lease = false;
  bool scope_admin = false;
};

/// The calling context of one request.
struct Ctx {
  AuthInfo auth;
  std::string request_id;
};

/// What a store decided for one operation: the typed result or the problem, and whether
/// it is the replay of an outcome stored under the request's Idempotency-Key. The store
/// decides outcomes; the HTTP edge (router.cpp) and the embedded control plane choose
/// statuses, headers and metric labels from them.
template <class T>
struct Outcome {
  expected<T, Problem> value;
  bool replayed = false;

  Outcome(T v, bool replay = false) : value(std::move(v)), replayed(replay) {}
  Outcome(Problem p, bool replay = false) : value(make_unexpected(std::move(p))), replayed(replay) {}
  Outcome(expected<T, Problem> v, bool replay = false) : value(std::move(v)), replayed(replay) {}
  bool ok() const { return value.has_value(); }
};

/// Called once with an operation's outcome, from a store thread, after it is durable.
template <class T>
using Then = std::function<void(Outcome<T>)>;

/// The answer of a release: nothing (204).
struct Released {};
/// The lease a revocation ended (not on the wire: revoke answers 204).
struct Revoked {
  std::string canonical_name;
  std::string memory_id;
};

/// Idempotency-Key and the request fingerprint (SHA-256 of method, path, canonical body).
struct Idempotency {
  std::string key;
  std::string fingerprint;
};

using lease::k_default_ttl_s;
using lease::k_max_ttl_s;
using lease::k_min_ttl_s;
inline constexpr std::int64_t k_idempotency_retention_ms = 24LL * 3600 * 1000;
/// Leases one Store::sweep removes at most (the PostgreSQL mep_sweep_r says 1000 too); a
/// sweep that removed this many rows is followed by the next one after 10 ms, not 1 s.
inline constexpr std::int64_t k_sweep_batch = 1000;
using lease::k_max_batch;

using RegisterMemory = lease::RegisterRequest;

struct Claim {
  std::string display_name;
  expected<CanonicalName, NameError> name; ///< canonicalized by the caller, outside the transaction
  std::string memory_id;
  std::string owner_client_id;
  std::int64_t ttl_s = k_default_ttl_s; ///< checked against the bounds inside the transaction
  /// False for the attempts of a waiting claim (Prefer: wait): a 423 (held) is answered but
  /// not recorded under the Idempotency-Key, so that the next attempt under the same key
  /// runs again instead of replaying the refusal. Every other outcome is recorded.
  bool record_refusal = true;
  /// The claim's place in the queue of claims that wait (Store::enter_queue); 0 for a
  /// claim that does not wait. A claim that would start a lease (not a re-claim of the
  /// caller's own live lease) is refused with 423 while an older claim waits for its name's
  /// skeleton or its memory: any waiting claim for a claim that does not wait, an earlier
  /// one for a waiting claim. So a claim that does not wait never takes a lease in the
  /// instant between a release and the attempt of the claim at the head of the queue.
  std::uint64_t ticket = 0;
  /// The live claims waiting ahead of this one in this server's queue for its skeleton or
  /// memory (below `ticket`; any, for a claim that does not wait), counted by the service
  /// when it sends the claim: the claim carries the queue state its decision needs, and the
  /// store never calls up into the service. SQLite reads it; PostgreSQL and Spanner count
  /// the waiters of every server in their own tables.
  std::size_t waiting_ahead = 0;
  /// Who asks (stored with the lease, shown to the tenant's requesters and operators).
  std::optional<lease::Holder> holder = std::nullopt;
  /// Renewals stop this long after the grant: the request's max_hold_seconds, or the
  /// server's ceiling (mep server --max-hold) when that is shorter or none was asked.
  std::optional<std::int64_t> max_hold_s = std::nullopt;
};

/// POST /v1/admin/leases/revoke: the live lease under a name ends now; `reason` (an
/// operator's words, at most 200 bytes) is told to its holder at its next renewal.
struct Revoke {
  std::string canonical_name;
  std::string reason = {};
};

/// GET /v1/admin/leases/{name}/history: the name's audit rows, newest first.
struct HistoryQuery {
  std::string canonical_name;
  std::optional<UnixMs> since;       ///< only rows at or after this time
  std::optional<std::string> cursor; ///< next_cursor of the page before
  std::size_t limit = 100;
};

/// What a waiting claim contends for: its name's skeleton and its memory.
struct QueuePlace {
  std::string tenant_id;
  std::string canonical_name;
  std::string skeleton;
  std::string memory_id;
};

/// A held lease as its holder presents it (renew, release; an item of renew-batch).
using LeaseRef = lease::LeaseRef;
using RenewBatch = lease::RenewBatchRequest;
using Branch = lease::BranchRequest;
using Verify = lease::VerifyRequest;

struct ListLeases {
  std::optional<std::string> owner_client_id;
  std::size_t limit = 100;
  std::optional<std::string> cursor; ///< the last canonical name of the previous page
};

/// A bearer token's metadata (never the token itself).
struct TokenInfo {
  std::string token_id;
  std::string tenant_id;
  std::string tenant_name;
  std::string scopes;
  UnixMs created_at = 0;
  std::optional<UnixMs> revoked_at;
};

struct AuditRow {
  std::string event_id;
  std::string tenant_id;
  std::string event_type;
  std::string redacted_name_hash;
  std::string redacted_memory_hash;
  std::optional<std::int64_t> fencing_token;
  UnixMs created_at = 0;
  std::optional<std::int64_t> renewals = std::nullopt; ///< on the end of a lease: its renewals
};

enum class Scope { lease, admin };

// The storage interface, by role: each consumer takes the role it needs (the lease
// service the lease operations and the claim queue, authentication the tokens, /metrics and
// /readyz the health, the `mep token` and `mep server audit` commands the administration),
// and a test fakes only that. A backend implements them all: `Store`.
// Asynchronous operations call `then` exactly once, from a store thread (reads: from the
// caller's), after the outcome is durable, with a typed Outcome: the store decides outcomes;
// statuses, headers and metric labels are the edge's. Synchronous ones may block briefly.

/// The lease operations and the reads of leases, memories and names (SPEC §6).
class LeaseStore {
public:
  virtual ~LeaseStore() = default;

  // Creating operations (Idempotency-Key required).
  virtual void register_memory(const Ctx&, Idempotency, RegisterMemory, Then<lease::Registered>) = 0;
  virtual void claim(const Ctx&, Idempotency, Claim, Then<lease::Grant>) = 0;
  virtual void branch(const Ctx&, Idempotency, Branch, Then<lease::Branched>) = 0;

  // Lease operations on a held lease.
  virtual void renew(const Ctx&, LeaseRef, Then<lease::Renewed>) = 0;
  virtual void renew_batch(const Ctx&, RenewBatch, Then<lease::RenewBatchResult>) = 0;
  virtual void release(const Ctx&, LeaseRef, Then<Released>) = 0;
  virtual void verify(const Ctx&, Verify, Then<lease::Verified>) = 0;
  virtual void revoke(const Ctx&, Revoke, Then<Revoked>) = 0;

  // Reads.
  virtual void get_lease(const Ctx&, std::string canonical_name, Then<lease::LeaseInfo>) = 0;
  virtual void list_leases(const Ctx&, ListLeases, Then<lease::LeasePage>) = 0;
  virtual void get_memory(const Ctx&, std::string memory_id, Then<lease::Memory>) = 0;
  virtual void lineage(const Ctx&, std::string memory_id, Then<lease::Lineage>) = 0;
  /// The audit rows of one name of the caller's tenant (found by the name's keyed hash).
  virtual void history(const Ctx&, HistoryQuery, Then<lease::HistoryPage>) = 0;
  /// GET /v1/migration/identity-map: the tenant's legacy_memory_ref → memory id entries.
  virtual void identity_map(const Ctx&, std::optional<std::string> cursor, std::size_t limit,
                            Then<lease::IdentityMapPage>) = 0;
};

/// The queue of waiting claims (Prefer: wait), shared by every server on the database:
/// tickets are handed out in order of arrival, and a claim's transaction refuses it while
/// an older ticket waits for its skeleton or memory (Claim::ticket).
class ClaimQueue {
public:
  virtual ~ClaimQueue() = default;
  /// A waiting claim takes its ticket (> 0, increasing). PostgreSQL: a row of mep_waiters,
  /// which counts while the server that took it renews it (once a second); SQLite: a
  /// counter (the queue is this process's own; see Claim::waiting_ahead).
  virtual void enter_queue(const Ctx&, QueuePlace, Then<std::uint64_t>) = 0;
  /// The ticket's claim stopped waiting without a grant (a grant removes it itself); the
  /// other servers' waiters for the same things are woken. Best effort, not waited for.
  virtual void leave_queue(std::uint64_t /*ticket*/) {}
  /// Its clients went away (true: it keeps its place for a retry but holds no one up) or a
  /// retry took its place back (false). Best effort, not waited for.
  virtual void mark_queue(std::uint64_t /*ticket*/, bool /*abandoned*/) {}
  /// This server stops: all its tickets go. Blocks briefly.
  virtual void leave_all_queues() {}
  /// Told of every lease ended by a release or a revocation through any server on the same
  /// database (PostgreSQL: LISTEN/NOTIFY), so that claims waiting here (Prefer: wait) are
  /// woken at once. Called from a store thread; empty stops the calls. A store that only
  /// one process serves (SQLite) never calls it: that process saw the release itself.
  using FreedListener = std::function<void(const std::string& canonical_name, const std::string& memory_id)>;
  virtual void set_freed_listener(FreedListener) {}
};

/// Bearer tokens as every request checks them.
class TokenStore {
public:
  virtual ~TokenStore() = default;
  /// The token whose SHA-256 is `token_sha256`, if it exists and is not revoked.
  virtual std::optional<AuthInfo> authenticate(const std::string& token_sha256) = 0;
  /// Records an AUTH_FAILED audit row (best effort, not waited for).
  virtual void audit_auth_failure(const std::string& tenant_id) = 0;
};

/// What /readyz and /metrics ask of the database, and the migration gate.
class StoreHealth {
public:
  virtual ~StoreHealth() = default;
  /// True when the database answers.
  virtual bool ready() = 0;
  /// Unexpired leases right now (for the mep_leases_active gauge).
  virtual std::int64_t active_leases() = 0;
  /// Unexpired leases right now per tenant, by tenant name (mep_leases_active_by_tenant).
  virtual std::vector<std::pair<std::string, std::int64_t>> active_leases_by_tenant() { return {}; }
  /// Transaction retries so far (PostgreSQL serializable mode; 0 elsewhere).
  virtual std::int64_t transaction_retries() { return 0; }
  /// Wall-clock steps found of the clock that decides expiry, when it is not this process's
  /// (PostgreSQL's: mep_clock_steps_total).
  virtual std::int64_t clock_steps() { return 0; }
  /// True between `mep migrate run` and `mep migrate activate` (SPEC §10): lease
  /// endpoints answer 503 migration-in-progress. Refreshed at least once a second.
  virtual bool migration_in_progress() = 0;
};

/// Administration: the `mep token` and `mep server audit` commands.
class StoreAdmin {
public:
  virtual ~StoreAdmin() = default;
  /// Creates the tenant if new and a token for it; returns {tenant_id, token}.
  virtual std::pair<std::string, std::string> create_token(const std::string& tenant_name, Scope) = 0;
  virtual std::vector<TokenInfo> list_tokens(const std::optional<std::string>& tenant_name) = 0;
  /// Revokes by token id; false when there is no such token.
  virtual bool revoke_token(const std::string& token_id) = 0;
  virtual std::vector<AuditRow> list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) = 0;
};

/// A backend: every role, and its life (the sweeper, the completion executor, shutdown).
class Store : public LeaseStore, public ClaimQueue, public TokenStore, public StoreHealth, public StoreAdmin {
public:
  /// Deletes expired (and, SQLite, released) leases and idempotency records, at most
  /// k_sweep_batch leases per call; returns how many rows were removed.
  virtual std::int64_t sweep() = 0;
  /// Where to run completion callbacks: given, a store that finishes many operations at
  /// once (SQLite group commit) hands them over in one call instead of calling each `then`
  /// on its own thread, so a batch costs the server one cross-thread wake-up, not one per
  /// request. Set before the first operation.
  using CompletionExecutor = std::function<void(std::function<void()>)>;
  virtual void set_completion_executor(CompletionExecutor) {}
  /// Shutting down: the operations queued and not started, and any submitted from now on,
  /// are answered with `why` (they never ran); the ones running finish. Their answers go
  /// through the completion executor, which must still run them.
  virtual void refuse_queued(const Problem& /*why*/) {}
};

/// Transaction isolation on PostgreSQL (SQLite transactions are always serializable).
enum class Isolation { read_committed, serializable };

/// Backend settings beyond the URL.
struct StoreOptions {
  Isolation isolation = Isolation::read_committed;
  /// PostgreSQL: connections (one worker thread each) that run lease operations.
  int pool = 16;
  /// SQLite: create the database when the file is missing. Commands that only read or
  /// revoke pass false, so that a mistyped path is an error, not a new empty database.
  bool create = true;
  /// SQLite: the nice value the thread that commits asks for (setpriority(2)), best
  /// effort: below 0 it needs CAP_SYS_NICE or RLIMIT_NICE, and without them it keeps the
  /// process's. 0 leaves it alone. See `mep server --writer-nice`.
  int writer_nice = 0;
  /// SQLite: this process serves the database (mep server): a second one is refused.
  bool serving = false;
};

/// Opens the store named by `url` (see check_db_url).
/// Creates and migrates the schema. Throws std::runtime_error with a readable message.
std::unique_ptr<Store> open_store(const std::string& url, const StoreOptions& options = {});

/// Throws when a database's schema `version` is newer than `ours`: a newer mep upgraded it,
/// and what this one would read or write may no longer mean what it did.
void refuse_newer_schema(std::int64_t version, int ours);

/// The tables of mep's first schema (both backends). mep creates its schema_version table
/// before any of them, and migrates a database that has none of them or that table too.
inline constexpr std::string_view k_first_schema_tables[] = {
    "tenants",     "tokens",       "memories", "leases",         "agent_names",
    "idempotency", "audit_events", "settings", "migration_rows", "migration_identity_map"};

/// Throws when a database without mep's schema (version 0) already has tables of mep's
/// names (`found`, comma-separated; empty: none): someone else's, which mep would misread.
void refuse_foreign_tables(const std::string& found);

/// The default database URL: sqlite:$XDG_STATE_HOME/mep/control.db.
std::string default_db_url();

/// `url` as the stores take it, or why it is refused: `sqlite:PATH` (also `sqlite://PATH`)
/// or `postgresql://…` / `postgres://…`, the scheme in any case (given on in lower case).
/// Anything else — a bare path, a mistyped scheme, libpq's `key=value` form — is refused
/// rather than opened as a new SQLite file in the current directory. The message never
/// repeats the URL, which may hold a password.
expected<std::string, std::string> check_db_url(const std::string& url);

} // namespace mep::server
