// The embedded SQLite store (SPEC §9): one writer thread committing concurrent
// requests in groups, read-only connections for reads and authentication.
//
// Design notes.
// * Durability: WAL with synchronous=FULL, so COMMIT returns after fsync. Every outcome
//   of a batch is handed over only after its COMMIT (writer_loop/run_batch): an
//   acknowledged grant survives a power loss, and a fencing token is never issued twice.
//   A batch of renewals alone commits without its fsync; the lease clock's checkpoint
//   makes good after a reboot what it may lose (see "Renewals" at anchor_clock).
// * After renewals, checkpoints run on a thread of their own, not on the writer
//   (on_wal_commit).
// * Group commit: run_batch opens one BEGIN IMMEDIATE transaction for all queued jobs
//   and commits once. Jobs run without savepoints; one that fails after writing sends
//   the batch to a second pass with a SAVEPOINT per job, so it rolls back alone.
//   Jobs run one at a time, so concurrent duplicates of one Idempotency-Key serialize.
// * Transitions of SPEC §4, by function: register (op_register), claim and takeover
//   (op_claim: expired rows conflicting on name, skeleton or memory are deleted with
//   the grant, §12.2, or rewritten when they are the claimed memory's row under the same
//   name), renew (op_renew: expiry = max(old, now+ttl)), release (release: the row stays,
//   marked released — expires_at = 0, see k_released), expiry (the clock; sweep removes
//   the rows later), branch (branch), revoke (revoke).
// * Fencing: the counter lives on the memory row (§12.1) and only grows; classify()
//   compares a presented token with the lease row *and* that counter, so a superseded
//   token (409) is told from an expired lease (410) even after the row is gone.
// * Idempotency (run_idempotent): keyed by (tenant, key) (§12.3); the outcome is stored
//   (stored_outcome.hpp: the API's status and body) in the same transaction as the
//   operation; definite refusals are stored (with nothing of the operation: it wrote
//   nothing, or its savepoint was rolled back), failures whose outcome may be unknown
//   (outcome_may_be_unknown: retry, unreachable, internal kinds) never. A replay reads it
//   back into the typed outcome.
#include "mep/sqlite_store.hpp"

#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/random.hpp"
#include "mep/uuid.hpp"
#include "mep/rows.hpp"
#include "mep/stored_outcome.hpp"

#include <boost/json/array.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <pthread.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::server {
namespace {

using sqlite::Db;
using sqlite::Use;

constexpr int k_schema_version = 10;
constexpr std::size_t k_max_group = 1024;
// The log's growth that wakes the checkpointer (SQLite's own default; see on_wal_commit);
// the length at which the writer checkpoints the log itself after a synced commit; and the
// size its file is cut back to when it starts again: above what synced commits leave
// (about 4,000 frames of 4 KiB), which are then written over in place, never cut and grown
// again (cycles at 8 and 64 clients ran 10 % slower with 4 MiB).
constexpr int k_wal_checkpoint_frames = 1000;
constexpr int k_wal_synced_frames = 4000;
// How long renewals answered from memory wait before they are written, at most, when no
// other request comes (see "Renewals from memory").
constexpr auto k_flush_delay = std::chrono::milliseconds(50);
// Rows that ended this long before now, and no longer ago, are read by list_leases too: a
// renewal from memory may have moved their expiry past now without the row knowing yet.
constexpr std::int64_t k_unflushed_margin_ms = 60'000;
constexpr std::int64_t k_wal_kept_bytes = 16 << 20;

constexpr std::string_view k_schema_v1 = R"sql(
CREATE TABLE IF NOT EXISTS tenants (
  tenant_id   TEXT PRIMARY KEY,
  name        TEXT NOT NULL UNIQUE,
  audit_salt  BLOB NOT NULL,
  created_at  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
  token_id     TEXT PRIMARY KEY,
  tenant_id    TEXT NOT NULL REFERENCES tenants(tenant_id),
  token_sha256 TEXT NOT NULL UNIQUE,
  scopes       TEXT NOT NULL,
  created_at   INTEGER NOT NULL,
  revoked_at   INTEGER
);
CREATE TABLE IF NOT EXISTS memories (
  memory_id          TEXT PRIMARY KEY,
  tenant_id          TEXT NOT NULL,
  parent_memory_id   TEXT,
  branched_at_token  INTEGER,
  fence_counter      INTEGER NOT NULL DEFAULT 0,
  created_at         INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS memories_parent ON memories(parent_memory_id);
CREATE TABLE IF NOT EXISTS leases (
  lease_id         TEXT PRIMARY KEY,
  tenant_id        TEXT NOT NULL,
  canonical_name   TEXT NOT NULL UNIQUE,
  display_name     TEXT NOT NULL,
  skeleton         TEXT NOT NULL UNIQUE,
  memory_id        TEXT NOT NULL UNIQUE,
  fencing_token    INTEGER NOT NULL,
  owner_client_id  TEXT NOT NULL,
  ttl_seconds      INTEGER NOT NULL,
  expires_at       INTEGER NOT NULL,
  acquired_at      INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_expiry ON leases(expires_at);
CREATE INDEX IF NOT EXISTS leases_owner ON leases(tenant_id, owner_client_id);
CREATE TABLE IF NOT EXISTS agent_names (
  canonical_name   TEXT PRIMARY KEY,
  display_name     TEXT NOT NULL,
  skeleton         TEXT NOT NULL,
  tenant_id        TEXT NOT NULL,
  unicode_version  TEXT NOT NULL,
  icu_version      TEXT NOT NULL,
  first_claimed_at INTEGER NOT NULL,
  last_claimed_at  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
  tenant_id    TEXT NOT NULL,
  idem_key     TEXT NOT NULL,
  fingerprint  TEXT NOT NULL,
  status       INTEGER NOT NULL,
  body         TEXT NOT NULL,
  created_at   INTEGER NOT NULL,
  expires_at   INTEGER NOT NULL,
  PRIMARY KEY (tenant_id, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency(expires_at);
CREATE TABLE IF NOT EXISTS audit_events (
  event_id              TEXT PRIMARY KEY,
  tenant_id             TEXT NOT NULL,
  event_type            TEXT NOT NULL,
  redacted_name_hash    TEXT NOT NULL,
  redacted_memory_hash  TEXT NOT NULL,
  fencing_token         INTEGER,
  created_at            INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS settings (
  key    TEXT PRIMARY KEY,
  value  TEXT NOT NULL
);
)sql";

// Version 2: legacy migration (SPEC §10): one row per migrated legacy agent, and the
// identity map from legacy memory references to memory ids.
constexpr std::string_view k_schema_v2 = R"sql(
CREATE TABLE IF NOT EXISTS migration_rows (
  legacy_id          TEXT PRIMARY KEY,
  tenant_id          TEXT NOT NULL,
  display_name       TEXT NOT NULL,
  canonical_name     TEXT NOT NULL UNIQUE,
  skeleton           TEXT NOT NULL UNIQUE,
  action             TEXT NOT NULL,
  reason             TEXT,
  memory_instance_id TEXT NOT NULL,
  legacy_memory_ref  TEXT NOT NULL,
  legacy_created_at  TEXT NOT NULL,
  migrated_at        INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS migration_identity_map (
  tenant_id          TEXT NOT NULL,
  legacy_memory_ref  TEXT NOT NULL,
  memory_instance_id TEXT NOT NULL,
  PRIMARY KEY (tenant_id, legacy_memory_ref)
);
)sql";

// Version 3: the tables every grant writes become clustered on the key they are found by
// (WITHOUT ROWID: one B-tree instead of a rowid table plus a unique index), and a lease is
// keyed by its memory (one live lease per memory; renew, release and verify find it by
// memory). A grant then touches fewer pages, so a commit writes fewer WAL frames.
// Rebuilt in place from version 2 (no foreign key refers to these tables).
constexpr std::string_view k_schema_v3 = R"sql(
CREATE TABLE memories_v3 (
  memory_id          TEXT PRIMARY KEY,
  tenant_id          TEXT NOT NULL,
  parent_memory_id   TEXT,
  branched_at_token  INTEGER,
  fence_counter      INTEGER NOT NULL DEFAULT 0,
  created_at         INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO memories_v3 SELECT memory_id, tenant_id, parent_memory_id, branched_at_token,
  fence_counter, created_at FROM memories;
DROP TABLE memories;
ALTER TABLE memories_v3 RENAME TO memories;
CREATE INDEX memories_parent ON memories(parent_memory_id);
CREATE TABLE leases_v3 (
  memory_id        TEXT PRIMARY KEY,
  lease_id         TEXT NOT NULL,
  tenant_id        TEXT NOT NULL,
  canonical_name   TEXT NOT NULL UNIQUE,
  display_name     TEXT NOT NULL,
  skeleton         TEXT NOT NULL UNIQUE,
  fencing_token    INTEGER NOT NULL,
  owner_client_id  TEXT NOT NULL,
  ttl_seconds      INTEGER NOT NULL,
  expires_at       INTEGER NOT NULL,
  acquired_at      INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO leases_v3 SELECT memory_id, lease_id, tenant_id, canonical_name, display_name, skeleton,
  fencing_token, owner_client_id, ttl_seconds, expires_at, acquired_at FROM leases;
DROP TABLE leases;
ALTER TABLE leases_v3 RENAME TO leases;
CREATE INDEX leases_expiry ON leases(expires_at);
CREATE INDEX leases_owner ON leases(tenant_id, owner_client_id);
CREATE TABLE agent_names_v3 (
  canonical_name   TEXT PRIMARY KEY,
  display_name     TEXT NOT NULL,
  skeleton         TEXT NOT NULL,
  tenant_id        TEXT NOT NULL,
  unicode_version  TEXT NOT NULL,
  icu_version      TEXT NOT NULL,
  first_claimed_at INTEGER NOT NULL,
  last_claimed_at  INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO agent_names_v3 SELECT canonical_name, display_name, skeleton, tenant_id, unicode_version,
  icu_version, first_claimed_at, last_claimed_at FROM agent_names;
DROP TABLE agent_names;
ALTER TABLE agent_names_v3 RENAME TO agent_names;
)sql";

// Version 4: listings page through an index in name order. With only (tenant, owner) a
// page of GET /v1/leases sorted all of the tenant's leases (190 ms for a page of 100 out of
// 100,000, on an I/O thread); now a page reads about as many index entries as it returns.
constexpr std::string_view k_schema_v4 = R"sql(
DROP INDEX IF EXISTS leases_owner;
CREATE INDEX leases_owner_name ON leases(tenant_id, owner_client_id, canonical_name);
CREATE INDEX leases_tenant_name ON leases(tenant_id, canonical_name);
)sql";

// Versions 5 (audit rows clustered on their event id) and 6 (no index on idempotency
// expiry) changed the two tables that version 7 rebuilds from any earlier form, so a
// database below version 7 goes straight to it; 5 and 6 are only recorded.

// Version 7: fewer pages per commit for the two tables every request appends to.
// - Audit rows go back to a rowid table, now with no index at all. Clustered on the event id
//   (version 5) every insert went into an index B-tree, whose splits rebalance three
//   siblings: 3.2 pages per commit for 3.6 rows. A rowid table appends, and nothing looks
//   an event up by its id (listings read the newest rows first, in rowid order).
// - Idempotency records are found through an index on the key alone instead of a unique
//   index on (tenant, key): entries of ~50 bytes instead of ~85, so pages split less often,
//   and keys that grow with time (mepd sends "claim-" + a UUIDv7) are still appended. The
//   lookup compares the tenant too; run_idempotent keeps one record per (tenant, key).
// Both tables are copied in rowid order: the sweeper relies on idempotency records
// expiring in that order.
constexpr std::string_view k_schema_v7 = R"sql(
CREATE TABLE audit_events_v7 (
  event_id              TEXT NOT NULL,
  tenant_id             TEXT NOT NULL,
  event_type            TEXT NOT NULL,
  redacted_name_hash    TEXT NOT NULL,
  redacted_memory_hash  TEXT NOT NULL,
  fencing_token         INTEGER,
  created_at            INTEGER NOT NULL
);
INSERT INTO audit_events_v7 SELECT event_id, tenant_id, event_type, redacted_name_hash,
  redacted_memory_hash, fencing_token, created_at FROM audit_events ORDER BY event_id;
DROP TABLE audit_events;
ALTER TABLE audit_events_v7 RENAME TO audit_events;
)sql";

// The idempotency table of version 7, rebuilt from any earlier form (the columns are named).
// Version 8 runs it again on databases that reached version 7 while that version looked
// records up through a 64-bit hash column (3810793): with time-ordered keys the hash
// scattered the inserts over the whole index (re-claims at 8 clients 7,258/s against
// 9,892/s for the key index, p99 5.8 ms against 2.3 ms).
constexpr std::string_view k_idempotency_v7 = R"sql(
CREATE TABLE idempotency_v7 (
  tenant_id    TEXT NOT NULL,
  idem_key     TEXT NOT NULL,
  fingerprint  TEXT NOT NULL,
  status       INTEGER NOT NULL,
  body         TEXT NOT NULL,
  created_at   INTEGER NOT NULL,
  expires_at   INTEGER NOT NULL
);
INSERT INTO idempotency_v7 SELECT tenant_id, idem_key, fingerprint, status, body, created_at,
  expires_at FROM idempotency ORDER BY rowid;
DROP TABLE idempotency;
ALTER TABLE idempotency_v7 RENAME TO idempotency;
CREATE INDEX idempotency_key ON idempotency(idem_key);
)sql";

// Version 10: who holds a lease and since when (holder metadata, granted_at, renewals,
// the hold limit), the last revocation of a memory (its holder is told why its renewal
// fails), and the renewals of a lease in the audit row that ends it. Columns only: no row
// is rewritten, and a lease row from before has no holder and its grant as its start.
struct NewColumn {
  std::string_view table;
  std::string_view column;
  std::string_view declaration;
};
constexpr NewColumn k_schema_v10[] = {
    {"leases", "holder", "TEXT"},          {"leases", "granted_at", "INTEGER"},
    {"leases", "renewed_at", "INTEGER"},   {"leases", "renewals", "INTEGER NOT NULL DEFAULT 0"},
    {"leases", "hold_until", "INTEGER"},   {"memories", "revoked_token", "INTEGER"},
    {"memories", "revoke_reason", "TEXT"}, {"audit_events", "renewals", "INTEGER"},
};

// Adds a column unless the table has it (a database whose version was set back by hand, or
// rebuilt from rows of a newer one, may).
void add_column(Db& db, const NewColumn& c) {
  Use s(db.prepare("SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2"));
  s->bind(1, c.table).bind(2, c.column);
  if (s->step()) return;
  db.exec(fmt::format("ALTER TABLE {} ADD COLUMN {} {}", c.table, c.column, c.declaration));
}

constexpr std::string_view k_lease_cols =
    "lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id, fencing_token, "
    "owner_client_id, ttl_seconds, expires_at, acquired_at, holder, granted_at, renewed_at, renewals, hold_until";

LeaseRow read_lease(sqlite::Stmt& s) {
  LeaseRow l;
  l.lease_id = s.text(0);
  l.tenant_id = s.text(1);
  l.canonical_name = s.text(2);
  l.display_name = s.text(3);
  l.skeleton = s.text(4);
  l.memory_id = s.text(5);
  l.fencing_token = s.int64(6);
  l.owner_client_id = s.text(7);
  l.ttl_s = s.int64(8);
  l.expires_at = s.int64(9);
  l.acquired_at = s.int64(10);
  l.holder = s.opt_text(11).value_or("");
  l.granted_at = s.opt_int64(12).value_or(l.acquired_at);
  l.renewed_at = s.opt_int64(13);
  l.renewals = s.int64(14);
  l.hold_until = s.opt_int64(15);
  return l;
}

std::optional<MemoryRow> find_memory(Db& db, const std::string& memory_id) {
  Use s(db.prepare("SELECT memory_id, tenant_id, parent_memory_id, branched_at_token, "
                   "fence_counter, created_at, revoked_token, revoke_reason FROM memories WHERE memory_id = ?1"));
  s->bind(1, memory_id);
  if (!s->step()) return std::nullopt;
  MemoryRow m;
  m.memory_id = s->text(0);
  m.tenant_id = s->text(1);
  m.parent_memory_id = s->opt_text(2);
  m.branched_at_token = s->opt_int64(3);
  m.fence_counter = s->int64(4);
  m.created_at = s->int64(5);
  m.revoked_token = s->opt_int64(6);
  m.revoke_reason = s->opt_text(7).value_or("");
  return m;
}

std::optional<LeaseRow> lease_by_memory(Db& db, const std::string& memory_id) {
  static const std::string sql = fmt::format("SELECT {} FROM leases WHERE memory_id = ?1", k_lease_cols);
  Use s(db.prepare(sql));
  s->bind(1, memory_id);
  if (!s->step()) return std::nullopt;
  return read_lease(*s);
}

std::optional<LeaseRow> lease_by_name(Db& db, const std::string& name) {
  static const std::string sql = fmt::format("SELECT {} FROM leases WHERE canonical_name = ?1", k_lease_cols);
  Use s(db.prepare(sql));
  s->bind(1, name);
  if (!s->step()) return std::nullopt;
  return read_lease(*s);
}

void delete_lease(Db& db, const std::string& memory_id) {
  Use s(db.prepare("DELETE FROM leases WHERE memory_id = ?1"));
  s->bind(1, memory_id).run();
}

// A released lease keeps its row with this expiry until the sweeper or the next claim of
// its memory or name removes or rewrites it: every reader already treats a row with
// `expires_at <= now` as no lease (so a released lease is one that has ended, as after a
// delete), and a release then writes one row and its expiry entry instead of deleting from
// six B-trees. Zero, not the release time: a clock stepped back must not revive it.
constexpr UnixMs k_released = 0;

// agent_names.last_claimed_at is kept to within this much (see op_claim).
constexpr std::int64_t k_name_history_resolution_ms = 60'000;

void mark_released(Db& db, const std::string& memory_id) {
  Use s(db.prepare("UPDATE leases SET expires_at = ?2 WHERE memory_id = ?1"));
  s->bind(1, memory_id).bind(2, k_released).run();
}

// Rewrites the lease row of `l.memory_id` with a new grant, leaving the name, skeleton and
// memory as they are, so that only the row and its expiry entry change (plus the owner
// index when the owner changes).
void rewrite_lease(Db& db, const LeaseRow& l, bool owner_changed) {
  // Two statements: SQLite updates every index with a column named in SET, changed or not.
  static const auto sql = [](std::string_view owner) {
    return fmt::format("UPDATE leases SET lease_id = ?1, display_name = ?2, fencing_token = ?3, "
                       "ttl_seconds = ?4, expires_at = ?5, acquired_at = ?6, holder = ?9, granted_at = ?10, "
                       "renewed_at = ?11, renewals = ?12, hold_until = ?13{} WHERE memory_id = ?7",
                       owner);
  };
  static const std::string keep_owner = sql(""), new_owner = sql(", owner_client_id = ?8");
  Use s(db.prepare(owner_changed ? new_owner : keep_owner));
  s->bind(1, l.lease_id)
      .bind(2, l.display_name)
      .bind(3, l.fencing_token)
      .bind(4, l.ttl_s)
      .bind(5, l.expires_at)
      .bind(6, l.acquired_at)
      .bind(7, l.memory_id)
      .bind(9, l.holder.empty() ? std::nullopt : std::optional<std::string>(l.holder))
      .bind(10, l.granted_at)
      .bind(11, l.renewed_at)
      .bind(12, l.renewals)
      .bind(13, l.hold_until);
  if (owner_changed) s->bind(8, l.owner_client_id);
  s->run();
}

std::string db_path_from_url(const std::string& url) {
  if (url.rfind("sqlite://", 0) == 0) return url.substr(9);
  if (url.rfind("sqlite:", 0) == 0) return url.substr(7);
  return url;
}

// Returns `path`; unless `create`, throws when no file is there.
std::string existing_unless(bool create, std::string path) {
  std::error_code ec;
  if (!create && !path.empty() && !std::filesystem::exists(path, ec))
    throw std::runtime_error(fmt::format("no database at {} (`mep token create` creates one)", path));
  return path;
}

// Creates the database's directory (0700) when it is missing, before any file beside
// the database is opened. Returns `path`.
std::string with_parent_directory(std::string path) {
  if (path.empty()) throw std::runtime_error("empty SQLite database path");
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    if (!std::filesystem::exists(parent, ec)) {
      std::filesystem::create_directories(parent, ec);
      if (ec) throw std::runtime_error("cannot create " + parent.string() + ": " + ec.message());
      ::chmod(parent.c_str(), 0700);
    }
  }
  return path;
}

// Takes PATH-serving.lock; throws when another process holds it.
int lock_serving(const std::string& path) {
  const int fd = try_lock_beside(path, "-serving.lock");
  if (fd < 0)
    throw std::runtime_error(fmt::format("another process (mep server, or mepd with its embedded control plane) is "
                                         "serving {}; SQLite serves one process only: stop it, or use PostgreSQL for "
                                         "several servers",
                                         path));
  return fd;
}

} // namespace

// ---- the lease clock ---------------------------------------------------------------------
//
// Expiry is decided on m_clock, never on the wall clock (SPEC §9), so a step of the wall
// clock neither shortens nor stretches a lease. Once a second (with the sweep) the clock's
// reading is saved with CLOCK_BOOTTIME and the boot id. A restart within the same boot
// goes on from that reading plus the boot time since, wall-clock steps while down
// included; after a reboot (a new boot id) the clock starts from the wall clock, but never
// below the saved reading, and every lease live at the saved reading keeps at least the
// time it had left then (leases are extended conservatively, as etcd's new leader does),
// and at least its TTL from the start.
//
// Renewals. A batch of nothing but renewals commits at synchronous=NORMAL: written to the
// log, not synced (run_batch). A process that crashes loses nothing of it (the kernel
// holds the writes); a reboot (power loss, a kernel crash) may lose renewals committed
// after the last sync. Every clock checkpoint is synced (the sweep's batch is never lazy),
// so a lost renewal ran after the last saved checkpoint, on a lease unexpired then: its
// row on disk is live at the saved reading, and after the reboot it keeps at least its
// TTL from the start, which ends after any expiry a lost renewal promised (a renewal that
// raises the TTL is synced before it is answered, so the TTL on disk is at least that of
// any lost renewal). Nobody else is granted the name before an acknowledged expiry, as
// SPEC §9 asks; the price is that after a reboot a dead holder's lease lasts up to one TTL
// longer. What it saves is an fsync per batch of renewals, and with it the stalls that
// come with each on a busy disk.
//
// Renewals from memory. A serving store answers most renewals without the writer: once
// the writer has renewed a lease (op_renew), it hands the lease to m_renewals, and later
// renewals with the same token, tenant, name, owner and TTL are answered there by the
// I/O thread (renew_from_memory), expiry = max(old, now + TTL) as op_renew would. The
// database is told afterwards: the first such renewal wakes the writer, whose next batch
// writes every expiry renewed since (flush_renewals, unsynced when nothing else is in the
// batch). Two rules keep this safe:
// * A lease is either in m_renewals or the writer's. Before the writer reads a lease row
//   to act on it (classify, op_claim's conflicts, revoke, the sweep) it takes the lease out
//   (settle), with a later expiry than the row's written back first; a renewal that comes
//   after that misses and goes to the writer. So the writer never ends a lease on an
//   expiry that a renewal from memory has moved, and no renewal from memory lands on a
//   lease the writer ended. What a transaction takes and hands over is undone with it.
// * A process that ends without flushing (a crash, kill -9) loses renewals it answered.
//   The clock checkpoint is saved with the clock's reading at its batch's flush, so such a
//   renewal came after the last checkpoint, on a lease whose row is live at it. A serving
//   store marks the database while it serves and clears the mark when it stops (after a
//   last, synced flush); started on a marked database in the same boot, it gives every
//   lease live at the checkpoint at least its TTL from the start, which ends after any
//   expiry a lost renewal promised (renewals from memory keep the TTL on disk). After a
//   reboot the rule above does the same. The price, as for lost lazy commits: after a
//   crash, a dead holder's lease may last up to one TTL longer.
// Readers (get_lease, list_leases) see m_renewals' expiries over the rows'.

namespace {
constexpr std::string_view k_clock_key = "lease_clock_checkpoint";
// Present while a process serves the database (see "Renewals from memory").
constexpr std::string_view k_serving_key = "serving";
} // namespace

void SqliteStore::anchor_clock() {
  std::optional<UnixMs> saved_ms;
  std::int64_t saved_boot_ms = 0;
  std::string saved_boot;
  {
    Use s(m_db->prepare("SELECT value FROM settings WHERE key = ?1"));
    s->bind(1, k_clock_key);
    if (s->step()) {
      char boot[64] = {0};
      long long ms = 0, bms = 0;
      if (std::sscanf(s->text(0).c_str(), "%lld %lld %63s", &ms, &bms, boot) == 3) {
        saved_ms = ms;
        saved_boot_ms = bms;
        saved_boot = boot;
      }
    }
  }
  bool crashed = false; // the last process that served it ended without its last flush
  if (m_serving) {
    Use s(m_db->prepare("SELECT 1 FROM settings WHERE key = ?1"));
    s->bind(1, k_serving_key);
    crashed = s->step();
  }
  if (!saved_ms) { // a new database: the wall clock it is, saved at once (see "Renewals")
    save_clock_checkpoint(*m_db, {m_clock.now(), boot_ms()});
    return;
  }
  const std::string boot = boot_id();
  if (!boot.empty() && boot == saved_boot) {
    const std::int64_t since = std::max<std::int64_t>(0, boot_ms() - saved_boot_ms);
    const UnixMs start = *saved_ms + since;
    m_clock = LeaseClock(start);
    if (!crashed) return;
    Use u(m_db->prepare("UPDATE leases SET expires_at = ?1 + ttl_seconds * 1000 "
                        "WHERE expires_at > ?2 AND ?1 + ttl_seconds * 1000 > expires_at"));
    u->bind(1, start).bind(2, *saved_ms).run();
    if (m_db->changes() > 0)
      log::info("the last server of this database did not stop cleanly: {} leases live at the last clock "
                "checkpoint keep at least their TTL",
                m_db->changes());
    return;
  }
  const UnixMs start = std::max(now_unix_ms(), *saved_ms);
  m_clock = LeaseClock(start);
  Use u(m_db->prepare("UPDATE leases SET expires_at = max(?1 + (expires_at - ?2), ?1 + ttl_seconds * 1000) "
                      "WHERE expires_at > ?2 AND max(?1 + (expires_at - ?2), ?1 + ttl_seconds * 1000) > expires_at"));
  u->bind(1, start).bind(2, *saved_ms).run();
  if (m_db->changes() > 0)
    log::info("after a reboot: {} leases live at the last clock checkpoint keep the time they had left then, "
              "and at least their TTL",
              m_db->changes());
}

void SqliteStore::save_clock_checkpoint(Db& db, std::pair<UnixMs, std::int64_t> at) {
  Use s(db.prepare("INSERT INTO settings(key, value) VALUES (?1, ?2) "
                   "ON CONFLICT(key) DO UPDATE SET value = excluded.value"));
  s->bind(1, k_clock_key).bind(2, fmt::format("{} {} {}", at.first, at.second, boot_id())).run();
}

// ---- construction and the writer -------------------------------------------------------

SqliteStore::SqliteStore(const std::string& url, bool create, int writer_nice, bool serving, int wal_writer_frames)
    : m_path(with_parent_directory(existing_unless(create, db_path_from_url(url)))),
      m_wal_writer_frames(std::max(wal_writer_frames, k_wal_checkpoint_frames)), m_writer_nice(writer_nice),
      m_tokens(m_path + "-token-epoch") {
  // SQLite serves one process: a second server on the same file would hand out the same
  // grants' state from two group-commit writers that know nothing of each other's caches.
  // Short commands (mep token, mep migrate) do not serve and may run beside it.
  if (serving) m_serving_lock = lock_serving(m_path);
  m_serving = serving;
  m_db = std::make_unique<Db>(m_path, sqlite::Mode::read_write_create);
  m_db->exec("PRAGMA journal_mode=WAL");
  m_db->exec("PRAGMA synchronous=FULL");
  m_db->exec("PRAGMA foreign_keys=ON");
  m_db->exec("PRAGMA cache_size=-8000");
  m_db->exec(fmt::format("PRAGMA journal_size_limit={}", k_wal_kept_bytes));
  ::chmod(m_path.c_str(), 0600);
  migrate();
  refresh_migration_state(*m_db);
  anchor_clock();
  if (m_serving) { // synced (synchronous=FULL): a crash from here on is seen at the next start
    Use s(m_db->prepare("INSERT INTO settings(key, value) VALUES (?1, '1') ON CONFLICT(key) DO NOTHING"));
    s->bind(1, k_serving_key).run();
  }
  m_checkpoint_db = std::make_unique<Db>(m_path, sqlite::Mode::read_write_create);
  m_checkpoint_db->exec("PRAGMA synchronous=FULL");
  ::sqlite3_wal_hook(m_db->handle(), &SqliteStore::on_wal_commit, this); // replaces SQLite's own checkpoints
  m_checkpointer = std::thread([this] { checkpoint_loop(); });
  m_writer = std::thread([this] { writer_loop(); });
}

SqliteStore::~SqliteStore() {
  {
    std::lock_guard lock(m_mutex);
    m_stopping = true;
  }
  m_cv.notify_all();
  if (m_writer.joinable()) m_writer.join();
  {
    std::lock_guard lock(m_checkpoint_mutex);
    m_checkpoint_stopping = true;
  }
  m_checkpoint_cv.notify_all();
  if (m_checkpointer.joinable()) m_checkpointer.join();
  if (m_serving_lock >= 0) ::close(m_serving_lock);
}

int sqlite_schema_version() { return k_schema_version; }

int try_lock_beside(const std::string& db_path, std::string_view suffix) {
  const std::string lock = with_parent_directory(db_path) + std::string(suffix);
  int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", lock, std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) return -1;
    throw std::runtime_error(fmt::format("cannot lock {}: {}", lock, std::strerror(err)));
  }
  return fd;
}

void SqliteStore::migrate() {
  m_db->exec("BEGIN IMMEDIATE");
  try {
    // In the transaction: a database refused below is left as it was.
    m_db->exec("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)");
    std::int64_t version = 0;
    {
      Use s(m_db->prepare("SELECT max(version) FROM schema_version"));
      if (s->step() && !s->is_null(0)) version = s->int64(0);
    }
    refuse_newer_schema(version, k_schema_version);
    if (version < 1) {
      std::string found;
      Use s(m_db->prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?"));
      for (std::string_view table : k_first_schema_tables) {
        s->reset();
        s->bind(1, table);
        if (s->step()) found += (found.empty() ? "" : ", ") + std::string(table);
      }
      refuse_foreign_tables(found);
    }
    if (version < 1) {
      m_db->exec(k_schema_v1);
      m_db->exec("INSERT INTO schema_version(version) VALUES (1)");
    }
    if (version < 2) {
      m_db->exec(k_schema_v2);
      m_db->exec("INSERT INTO schema_version(version) VALUES (2)");
    }
    if (version < 3) {
      m_db->exec(k_schema_v3);
      m_db->exec("INSERT INTO schema_version(version) VALUES (3)");
    }
    if (version < 4) {
      m_db->exec(k_schema_v4);
      m_db->exec("INSERT INTO schema_version(version) VALUES (4)");
    }
    if (version < 5) m_db->exec("INSERT INTO schema_version(version) VALUES (5)"); // see k_schema_v7
    if (version < 6) m_db->exec("INSERT INTO schema_version(version) VALUES (6)");
    if (version < 7) {
      m_db->exec(k_schema_v7);
      m_db->exec(k_idempotency_v7);
      m_db->exec("INSERT INTO schema_version(version) VALUES (7)");
    }
    if (version < 8) {
      if (version == 7) m_db->exec(k_idempotency_v7); // see k_idempotency_v7
      m_db->exec("INSERT INTO schema_version(version) VALUES (8)");
    }
    if (version < 9) {
      // Version 9: a stored 423 or 429 keeps its Retry-After for its replays, as on PostgreSQL.
      m_db->exec("ALTER TABLE idempotency ADD COLUMN retry_after INTEGER");
      m_db->exec("INSERT INTO schema_version(version) VALUES (9)");
    }
    if (version < 10) {
      for (const auto& c : k_schema_v10) add_column(*m_db, c);
      m_db->exec("INSERT INTO schema_version(version) VALUES (10)");
    }
    m_db->exec("COMMIT");
  } catch (...) {
    m_db->exec("ROLLBACK");
    throw;
  }
}

void SqliteStore::enqueue(Work work, Finish done, std::string request_id, bool careful, bool lazy) {
  {
    std::unique_lock lock(m_mutex);
    if (m_refusing) {
      const Problem why = *m_refusing;
      lock.unlock();
      return done(why);
    }
    m_queue.push_back(Job{std::move(work), std::move(done), std::move(request_id), careful, lazy});
  }
  m_cv.notify_one();
}

void SqliteStore::refuse_queued(const Problem& why) {
  std::deque<Job> refused;
  {
    std::lock_guard lock(m_mutex);
    m_refusing = why;
    refused.swap(m_queue);
  }
  if (!refused.empty()) log::info("refused {} queued database operations: {}", refused.size(), why.detail);
  for (Job& job : refused) {
    try {
      job.done(why);
    } catch (const std::exception& e) {
      log::error("request {}: answering failed: {}", job.request_id, e.what());
    }
  }
}

template <class T, class Op>
void SqliteStore::submit(Op op, Then<T> then, std::string request_id, bool lazy) {
  // The outcome lives here between the job's run (writer thread) and its hand-over. A
  // batch run twice (see run_batch) replaces it.
  struct Kept {
    std::optional<Outcome<T>> outcome;
    Then<T> then;
  };
  auto kept = std::make_shared<Kept>(Kept{std::nullopt, std::move(then)});
  enqueue([op = std::move(op), kept](Db& db, UnixMs now) { kept->outcome.emplace(op(db, now)); },
          [kept](std::optional<Problem> failure) {
            if (failure || !kept->outcome)
              return kept->then(Outcome<T>(failure ? std::move(*failure) : db_unavailable()));
            kept->then(std::move(*kept->outcome));
          },
          std::move(request_id), /*careful=*/false, lazy);
}

template <class T>
void SqliteStore::read(const std::function<Outcome<T>(Db&, UnixMs)>& op, const Then<T>& then) {
  std::optional<Outcome<T>> out;
  try {
    auto rd = reader();
    out.emplace(op(rd.db(), m_clock.now()));
  } catch (const sqlite::Error& e) {
    log::error("read failed: {}", e.what());
    out.emplace(db_unavailable());
  }
  then(std::move(*out));
}

void SqliteStore::writer_loop() {
  ::pthread_setname_np(::pthread_self(), "mep-writer");
  // Every request waits for this thread, which sleeps in each commit's fdatasync. Woken,
  // it competes for a CPU with the I/O threads and with the clients on the same machine;
  // with a higher priority it runs at once, and batches follow each other sooner.
  if (m_writer_nice != 0) {
    errno = 0;
    const int own = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
    if (errno == 0) m_own_nice = own;
    if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), m_writer_nice) == 0) {
      log::debug("the commit thread runs at nice {}", m_writer_nice);
      m_nice_switch = m_own_nice.has_value() && m_writer_nice < *m_own_nice;
    } else
      log::debug("the commit thread keeps its priority: nice {}: {}", m_writer_nice, std::strerror(errno));
  }
  std::vector<Job> batch;
  for (;;) {
    {
      std::unique_lock lock(m_mutex);
      m_cv.wait(lock, [&] { return !m_queue.empty() || m_stopping || m_flush_wanted; });
      // Renewals from memory alone wait a little for more, and for requests to flush with:
      // a lease renewed again meanwhile is written once.
      if (m_queue.empty() && !m_stopping)
        m_cv.wait_for(lock, k_flush_delay, [&] { return !m_queue.empty() || m_stopping; });
      if (m_queue.empty() && m_stopping) break;
      m_flush_wanted = false; // an empty batch flushes m_renewals all the same
      std::size_t n = std::min(m_queue.size(), k_max_group);
      batch.assign(std::make_move_iterator(m_queue.begin()),
                   std::make_move_iterator(m_queue.begin() + static_cast<std::ptrdiff_t>(n)));
      m_queue.erase(m_queue.begin(), m_queue.begin() + static_cast<std::ptrdiff_t>(n));
    }
    run_batch(batch);
    batch.clear();
  }
  stop_serving();
}

void SqliteStore::stop_serving() {
  if (!m_serving) return;
  std::vector<Job> last;
  last.push_back(Job{[](Db& db, UnixMs) {
                       Use s(db.prepare("DELETE FROM settings WHERE key = ?1"));
                       s->bind(1, k_serving_key).run();
                     },
                     [](std::optional<Problem> failure) {
                       if (failure) log::warn("the last renewals could not be written: the next start extends leases");
                     },
                     {},
                     /*careful=*/true,
                     /*lazy=*/false});
  m_complete = nullptr; // the I/O threads may be gone: answered here
  m_renewals.close();   // a renewal from here on goes to the (stopped) writer, not to memory
  run_batch(last);
}

// ---- checkpoints ----------------------------------------------------------------------------
//
// After a synced commit the writer checkpoints the log itself once it holds 4,000 frames:
// the log starts again from its beginning at the next transaction and its file is written
// over in place (claims at 8 clients ran 20 % slower when the log was left to grow and
// another thread checkpointed it: a synced commit that appends to a growing file costs the
// file system more, and the two threads' fsyncs meet). Meanwhile, each time the log has
// grown by k_wal_checkpoint_frames, a thread of its own checkpoints PASSIVE (it never blocks
// the writer or a reader): it copies most of the log's pages into the database while the
// writer goes on, so the writer's own checkpoint finds little left to copy. (At 1,000
// frames and done by the writer alone, checkpoints took 19 % of the writer's time in fresh
// claims at 64 clients; see bench/README.md for the A/B.)
// After a commit that was not synced (renewals), copying pages and two fsyncs (the log's,
// then the database file's) would be most of the writer's time: only that thread
// checkpoints then. A passive checkpoint beside a busy writer never catches the end of the
// log, so it does not start again; the writer checkpoints itself at the next synced commit
// past 4,000 frames, or when the log reaches m_wal_writer_frames (32,000 frames, 128 MiB):
// the log stays bounded. Should a reader keep it from starting again, the writer tries again
// k_wal_checkpoint_frames later. When it starts again the file is cut back to 16 MiB.

int SqliteStore::on_wal_commit(void* self_, sqlite3* db, const char* schema, int frames) {
  auto* self = static_cast<SqliteStore*>(self_);
  if (frames < self->m_wal_frames) { // the log started again
    self->m_wal_asked = 0;
    self->m_wal_retry_at = 0;
  }
  self->m_wal_frames = frames;
  const int limit = self->m_lazy_commits ? self->m_wal_writer_frames : k_wal_synced_frames;
  if (frames >= std::max(limit, self->m_wal_retry_at)) {
    int rc = ::sqlite3_wal_checkpoint_v2(db, schema, SQLITE_CHECKPOINT_PASSIVE, nullptr, nullptr);
    if (rc != SQLITE_OK && rc != SQLITE_BUSY) log::warn("checkpoint failed: {}", ::sqlite3_errstr(rc));
    Metrics::global().inc("mep_sqlite_checkpoints_total", "by=\"writer\"");
    self->m_wal_retry_at = frames + k_wal_checkpoint_frames;
    self->m_wal_asked = frames;
  } else if (frames - self->m_wal_asked >= k_wal_checkpoint_frames) {
    self->m_wal_asked = frames;
    {
      std::lock_guard lock(self->m_checkpoint_mutex);
      self->m_checkpoint_wanted = true;
    }
    self->m_checkpoint_cv.notify_one();
  }
  return SQLITE_OK;
}

void SqliteStore::checkpoint_loop() {
  ::pthread_setname_np(::pthread_self(), "mep-checkpoint");
  for (;;) {
    {
      std::unique_lock lock(m_checkpoint_mutex);
      m_checkpoint_cv.wait(lock, [&] { return m_checkpoint_wanted || m_checkpoint_stopping; });
      if (m_checkpoint_stopping) return;
      m_checkpoint_wanted = false;
    }
    try {
      int rc =
          ::sqlite3_wal_checkpoint_v2(m_checkpoint_db->handle(), nullptr, SQLITE_CHECKPOINT_PASSIVE, nullptr, nullptr);
      if (rc == SQLITE_OK)
        Metrics::global().inc("mep_sqlite_checkpoints_total", "by=\"checkpointer\"");
      else if (rc != SQLITE_BUSY) // the writer checkpoints itself when the log grows long
        log::warn("checkpoint failed: {}", ::sqlite3_errmsg(m_checkpoint_db->handle()));
    } catch (const std::exception& e) {
      log::error("checkpointer: {}", e.what());
    }
  }
}

// Makes the last commit durable as synchronous=FULL would have: syncs the log, through
// SQLite's own handle of it.
void SqliteStore::sync_wal() {
  sqlite3_file* wal = nullptr;
  int rc = ::sqlite3_file_control(m_db->handle(), "main", SQLITE_FCNTL_JOURNAL_POINTER, &wal);
  if (rc == SQLITE_OK && (!wal || !wal->pMethods)) rc = SQLITE_IOERR_FSYNC;
  if (rc == SQLITE_OK) rc = wal->pMethods->xSync(wal, SQLITE_SYNC_NORMAL);
  if (rc != SQLITE_OK) throw sqlite::Error(rc, std::string("cannot sync the log: ") + ::sqlite3_errstr(rc));
}

namespace {
// Thrown inside an optimistic pass when a job's writes must be undone.
struct NeedsCarefulRun {};
} // namespace

// A batch first runs optimistically: no savepoints. Each job's first change to a page
// inside a SAVEPOINT copies the page into SQLite's statement journal, and that copying
// was a fifth of the writer's time at 64 clients. Jobs check before they write (a claim
// finds its conflicts before it removes expired leases), so a job that must be undone is
// rare: one that throws (an I/O error, a bug) or an idempotent operation that fails
// after writing. Then the whole transaction is rolled back and the batch runs again,
// each job in its own SAVEPOINT as before. Nothing was acknowledged in between; counters
// that the first pass incremented for the jobs before the failing one count them twice.
void SqliteStore::run_batch(std::vector<Job>& batch) {
  std::vector<std::optional<Problem>> failures(batch.size());
  auto fail_batch = [&] {
    m_renewals.rolled_back();
    m_healthy = false;
    for (auto& job : batch) job.done(db_unavailable());
  };
  bool careful = std::any_of(batch.begin(), batch.end(), [](const Job& j) { return j.careful; });
  // A batch of renewals only commits without its fsync (see "Renewals" in the notes on
  // the lease clock); the level can only change between transactions. Such a commit
  // waits for no disk, so the writer keeps no higher priority than the I/O threads then.
  const bool lazy = std::all_of(batch.begin(), batch.end(), [](const Job& j) { return j.lazy; });
  if (lazy != m_lazy_commits) {
    try {
      Use(m_db->prepare(lazy ? "PRAGMA synchronous=NORMAL" : "PRAGMA synchronous=FULL"))->run();
    } catch (const sqlite::Error& e) {
      log::error("database error: {}", e.what());
      return fail_batch();
    }
    m_lazy_commits = lazy;
    if (m_nice_switch) ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), lazy ? *m_own_nice : m_writer_nice);
  }
  m_must_sync = false;
  const auto began = std::chrono::steady_clock::now();
  for (;;) {
    try {
      Use(m_db->prepare("BEGIN IMMEDIATE"))->run(); // prepared once: no parsing per batch
    } catch (const sqlite::Error& e) {
      log::error("database error: {}", e.what());
      return fail_batch();
    }
    // The clock's reading before the flush: what a checkpoint saved in this batch holds
    // (see "Renewals from memory").
    m_flushed_at = {m_clock.now(), boot_ms()};
    Pass pass = Pass::done;
    try {
      flush_renewals(*m_db);
    } catch (const sqlite::Error& e) {
      log::error("database error: {}", e.what());
      pass = Pass::aborted; // the batch fails with it: rolled back below, renewals pending again
    }
    if (pass == Pass::done) pass = run_jobs(batch, failures, careful);
    // Requests that arrived while the batch ran join it before the COMMIT: one more fsync
    // shared instead of a batch of their own after this one's.
    for (std::size_t n; pass == Pass::done && (n = extend_batch(batch, careful, m_lazy_commits, began)) > 0;) {
      failures.resize(batch.size());
      pass = run_jobs(batch, failures, careful, batch.size() - n);
    }
    if (pass == Pass::done) break;
    if (!::sqlite3_get_autocommit(m_db->handle())) {
      try {
        m_db->exec("ROLLBACK");
      } catch (const sqlite::Error& e) {
        log::error("rollback failed: {}", e.what());
        pass = Pass::aborted;
      }
    }
    m_renewals.rolled_back();
    if (pass == Pass::aborted || careful) return fail_batch();
    log::debug("a batch of {} requests runs again, each in a savepoint", batch.size());
    careful = true;
  }
  try {
    auto started = std::chrono::steady_clock::now();
    Use(m_db->prepare("COMMIT"))->run();
    const bool deferred = m_lazy_commits && !m_must_sync;
    if (m_lazy_commits && m_must_sync) sync_wal();
    auto& metrics = Metrics::global();
    metrics.observe("mep_sqlite_commit_duration_seconds", {},
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    metrics.inc("mep_sqlite_commits_total", deferred ? "sync=\"deferred\"" : "sync=\"fsync\"");
    metrics.inc("mep_sqlite_committed_requests_total", {}, static_cast<double>(batch.size()));
    m_renewals.committed();
    m_healthy = true;
  } catch (const sqlite::Error& e) {
    log::error("commit failed: {}", e.what());
    try {
      m_db->exec("ROLLBACK");
    } catch (...) {}
    m_renewals.rolled_back();
    m_healthy = false;
    for (auto& f : failures) f = db_unavailable();
  }
  if (batch.empty()) return; // a flush alone
  if (m_complete) {
    // One hand-over for the whole batch (see Store::set_completion_executor): the replies
    // are rendered and written by the I/O threads, not here. run_sync's callers wait on
    // their own, maybe on an I/O thread: they are answered from here.
    std::vector<std::pair<Finish, std::optional<Problem>>> finished;
    finished.reserve(batch.size());
    for (std::size_t i = 0; i < batch.size(); ++i) {
      if (batch[i].careful)
        batch[i].done(std::move(failures[i]));
      else
        finished.emplace_back(std::move(batch[i].done), std::move(failures[i]));
    }
    m_complete([finished = std::move(finished)]() mutable {
      for (auto& [done, failure] : finished) done(std::move(failure));
    });
    return;
  }
  for (std::size_t i = 0; i < batch.size(); ++i) batch[i].done(std::move(failures[i]));
}

// Takes waiting requests into the batch while it is open: at most k_max_group in all, for
// at most k_max_extension after the batch began (a steady stream must not hold back the
// COMMIT of the requests already run), and in an optimistic pass none that must run
// carefully (they wait for the next batch).
std::size_t SqliteStore::extend_batch(std::vector<Job>& batch, bool careful, bool lazy,
                                      std::chrono::steady_clock::time_point began) {
  constexpr auto k_max_extension = std::chrono::microseconds(250);
  if (std::chrono::steady_clock::now() - began > k_max_extension) return 0;
  std::lock_guard lock(m_mutex);
  std::size_t n = 0;
  while (!m_queue.empty() && batch.size() < k_max_group && (careful || !m_queue.front().careful) &&
         (!lazy || m_queue.front().lazy)) {
    batch.push_back(std::move(m_queue.front()));
    m_queue.pop_front();
    ++n;
  }
  return n;
}

SqliteStore::Pass SqliteStore::run_jobs(std::vector<Job>& batch, std::vector<std::optional<Problem>>& failures,
                                        bool careful, std::size_t from) {
  m_careful = careful;
  for (std::size_t i = from; i < batch.size(); ++i) {
    const std::int64_t before = m_db->total_changes();
    const RenewalTable::Mark mark = m_renewals.mark();
    try {
      if (careful) Use(m_db->prepare("SAVEPOINT job"))->run();
      m_pending_audit.clear();
      failures[i].reset();
      batch[i].work(*m_db, m_clock.now());
      write_pending_audit();
      if (careful) Use(m_db->prepare("RELEASE job"))->run();
    } catch (const NeedsCarefulRun&) {
      return Pass::run_carefully;
    } catch (const std::exception& e) {
      // After SQLITE_FULL, an I/O error or out-of-memory SQLite may have rolled the whole
      // transaction back: every earlier job of the batch is gone with it.
      if (::sqlite3_get_autocommit(m_db->handle())) {
        log::error("request {} failed and ended the transaction: {}", batch[i].request_id, e.what());
        return Pass::aborted;
      }
      if (!careful && m_db->total_changes() != before) return Pass::run_carefully; // logged then
      log::error("request {} failed: {}", batch[i].request_id, e.what());
      if (careful) {
        try {
          m_db->exec("ROLLBACK TO job; RELEASE job");
          m_renewals.undo_to(mark);
        } catch (const sqlite::Error& e2) {
          log::error("rollback of a request failed: {}", e2.what());
          return Pass::aborted;
        }
      }
      bool io = dynamic_cast<const sqlite::Error*>(&e) != nullptr;
      failures[i] = io ? db_unavailable() : Problem(Code::internal, "internal error");
    }
  }
  return Pass::done;
}

// Runs fn as a job of its own kind: in a SAVEPOINT from the start (it may not run twice),
// answered on the writer thread (the caller may be an I/O thread), and only after the
// COMMIT: a caller that returns has its change on disk (mep token revoke relies on it).
template <typename T>
T SqliteStore::run_sync(std::function<T(Db&, UnixMs)> fn) {
  std::promise<T> promise;
  auto future = promise.get_future();
  std::optional<T> value;
  std::exception_ptr error;
  enqueue(
      [&](Db& db, UnixMs now) {
        try {
          value.emplace(fn(db, now));
        } catch (...) {
          error = std::current_exception();
          throw; // the job's savepoint is rolled back
        }
      },
      [&](std::optional<Problem> failure) {
        if (error)
          promise.set_exception(error);
        else if (failure || !value)
          promise.set_exception(std::make_exception_ptr(sqlite::Error(SQLITE_IOERR, "the database is unavailable")));
        else
          promise.set_value(std::move(*value));
      },
      {}, /*careful=*/true);
  return future.get();
}

SqliteStore::ReaderLease SqliteStore::reader() {
  std::unique_ptr<Db> db;
  {
    std::lock_guard lock(m_readers_mutex);
    if (!m_readers.empty()) {
      db = std::move(m_readers.back());
      m_readers.pop_back();
    }
  }
  if (!db) db = std::make_unique<Db>(m_path, sqlite::Mode::read_only);
  return ReaderLease(this, std::move(db));
}

SqliteStore::ReaderLease::~ReaderLease() {
  if (!m_db) return;
  std::lock_guard lock(m_store->m_readers_mutex);
  if (m_store->m_readers.size() < 16) m_store->m_readers.push_back(std::move(m_db));
}

// ---- audit ------------------------------------------------------------------------------

const HmacSha256& SqliteStore::audit_mac(Db& db, const std::string& tenant_id) {
  auto it = m_audit_macs.find(tenant_id);
  if (it != m_audit_macs.end()) return it->second;
  std::string salt;
  Use q(db.prepare("SELECT audit_salt FROM tenants WHERE tenant_id = ?1"));
  q->bind(1, tenant_id);
  if (q->step()) salt = q->text(0);
  return m_audit_macs.emplace(tenant_id, HmacSha256(salt)).first->second;
}

void SqliteStore::audit(const std::string& tenant_id, std::string_view type, std::string_view name,
                        std::string_view memory_id, std::optional<std::int64_t> token,
                        std::optional<std::int64_t> renewals) {
  m_pending_audit.push_back(
      PendingAudit{tenant_id, std::string(type), std::string(name), std::string(memory_id), token, renewals});
}

void SqliteStore::write_pending_audit() {
  for (const auto& a : m_pending_audit) {
    const HmacSha256& mac = audit_mac(*m_db, a.tenant_id);
    Use s(m_db->prepare("INSERT INTO audit_events(event_id, tenant_id, event_type, "
                        "redacted_name_hash, redacted_memory_hash, fencing_token, created_at, renewals) "
                        "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"));
    s->bind(1, uuid_v7().to_string())
        .bind(2, a.tenant_id)
        .bind(3, a.type)
        .bind(4, a.name.empty() ? std::string() : mac.hex(a.name))
        .bind(5, a.memory_id.empty() ? std::string() : mac.hex(a.memory_id))
        .bind(6, a.token)
        .bind(7, now_unix_ms())
        .bind(8, a.renewals)
        .run();
  }
  m_pending_audit.clear();
}

// ---- idempotency ------------------------------------------------------------------------

template <class T>
Outcome<T> SqliteStore::run_idempotent(Db& db, UnixMs now, const Ctx& ctx, const Idempotency& idem,
                                       const std::function<expected<T, Problem>()>& op, bool record_refusal) {
  auto& metrics = Metrics::global();
  std::optional<std::int64_t> expired_record;
  {
    Use s(db.prepare("SELECT rowid, expires_at, fingerprint, status, body, retry_after FROM idempotency "
                     "WHERE idem_key = ?1 AND tenant_id = ?2"));
    s->bind(1, idem.key).bind(2, ctx.auth.tenant_id);
    // At most one record per (tenant, key); an expired one not yet swept is replaced below.
    const bool found = s->step();
    if (found && s->int64(1) <= now) expired_record = s->int64(0);
    if (found && !expired_record) {
      if (s->text(2) != idem.fingerprint) {
        metrics.inc("mep_idempotency_lookups_total", "result=\"mismatch\"");
        return Outcome<T>(
            Problem(Code::idempotency_key_reused, "this Idempotency-Key was used with a different request"));
      }
      metrics.inc("mep_idempotency_lookups_total", "result=\"hit\"");
      StoredOutcome stored{static_cast<int>(s->int64(3)), s->text(4), std::nullopt};
      if (auto ra = s->opt_int64(5)) stored.retry_after_s = static_cast<int>(*ra);
      return replay_outcome<T>(stored);
    }
  }
  metrics.inc("mep_idempotency_lookups_total", "result=\"miss\"");
  // A failed operation leaves nothing behind but its stored outcome. Optimistic pass
  // (run_batch): operations check before they write, and one that wrote anyway sends
  // the batch to its careful pass, where the SAVEPOINT undoes it.
  std::optional<expected<T, Problem>> result;
  if (m_careful) {
    Use(db.prepare("SAVEPOINT op"))->run();
    try {
      result.emplace(op());
    } catch (...) {
      db.exec("ROLLBACK TO op; RELEASE op");
      throw;
    }
    if (!*result) db.exec("ROLLBACK TO op");
    Use(db.prepare("RELEASE op"))->run();
  } else {
    const std::int64_t before = db.total_changes();
    result.emplace(op());
    if (!*result && db.total_changes() != before) throw NeedsCarefulRun{};
  }
  const Problem* refused = *result ? nullptr : &result->error();
  if (!refused || (!outcome_may_be_unknown(refused->code) && (record_refusal || refused->kind() != Kind::held))) {
    if (expired_record) {
      Use s(db.prepare("DELETE FROM idempotency WHERE rowid = ?1"));
      s->bind(1, *expired_record).run();
    }
    StoredOutcome stored = store_outcome(*result, ctx.request_id);
    Use s(db.prepare("INSERT INTO idempotency(tenant_id, idem_key, fingerprint, status, "
                     "body, created_at, expires_at, retry_after) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"));
    s->bind(1, ctx.auth.tenant_id)
        .bind(2, idem.key)
        .bind(3, idem.fingerprint)
        .bind(4, static_cast<std::int64_t>(stored.status))
        .bind(5, stored.body)
        .bind(6, now)
        .bind(7, now + k_idempotency_retention_ms)
        .bind(8, stored.retry_after_s ? std::optional<std::int64_t>(*stored.retry_after_s) : std::nullopt)
        .run();
  }
  return Outcome<T>(std::move(*result));
}

// ---- fencing classification -------------------------------------------------------------

// What a presented (memory, token) refers to (rules::classify), read on the writer's
// connection; a stale token is audited and counted.
expected<LeaseRow, Problem> SqliteStore::classify(Db& db, UnixMs now, const Ctx& ctx, const std::string& memory_id,
                                                  std::int64_t token, Code not_found) {
  auto mem = find_memory(db, memory_id);
  std::optional<LeaseRow> lease;
  if (mem && mem->tenant_id == ctx.auth.tenant_id && token == mem->fence_counter) {
    lease = lease_by_memory(db, memory_id);
    if (lease) settle(db, *lease);
  }
  bool stale = false;
  auto r = rules::classify(ctx, mem, lease, token, now, not_found, &stale);
  if (stale) {
    audit(ctx.auth.tenant_id, "STALE_FENCE_REJECTED", {}, memory_id, token);
    Metrics::global().inc("mep_fencing_rejections_total");
  }
  return r;
}

// ---- renewals from memory (see the notes at the lease clock) ----------------------------------

namespace {
// When the last renewal from memory was made: its expiry is that renewal's time + TTL
// (a renewal from memory always moves the expiry to now + TTL, the clock being monotonic).
UnixMs renewed_at_of(const RenewalTable::Lease& l) { return l.expires_at - l.ttl_s * 1000; }

// Renewals from memory, written to their row (unless the row was released or granted again):
// the later expiry and the renewals counted.
void write_renewal(Db& db, const std::string& memory_id, const RenewalTable::Lease& l) {
  // (Every expression of SET reads the row as it was.)
  Use s(db.prepare("UPDATE leases SET ttl_seconds = CASE WHEN expires_at < ?2 THEN ?3 ELSE ttl_seconds END, "
                   "expires_at = max(expires_at, ?2), renewals = renewals + ?6, "
                   "renewed_at = CASE WHEN ?6 > 0 THEN ?7 ELSE renewed_at END "
                   "WHERE memory_id = ?1 AND fencing_token = ?4 AND expires_at != ?5 AND (expires_at < ?2 OR ?6 > 0)"));
  s->bind(1, memory_id)
      .bind(2, l.expires_at)
      .bind(3, l.ttl_s)
      .bind(4, l.fencing_token)
      .bind(5, k_released)
      .bind(6, l.renewals)
      .bind(7, renewed_at_of(l))
      .run();
}
} // namespace

void SqliteStore::settle(Db& db, LeaseRow& row) {
  auto kept = m_renewals.take(row.memory_id);
  if (!kept || kept->fencing_token != row.fencing_token || row.expires_at == k_released ||
      (kept->expires_at <= row.expires_at && kept->renewals == 0))
    return;
  write_renewal(db, row.memory_id, *kept);
  if (kept->expires_at > row.expires_at) {
    row.expires_at = kept->expires_at;
    row.ttl_s = kept->ttl_s;
  }
  if (kept->renewals > 0) {
    row.renewals += kept->renewals;
    row.renewed_at = renewed_at_of(*kept);
  }
}

void SqliteStore::overlay(LeaseRow& row) const {
  if (!m_serving || row.expires_at == k_released) return;
  auto l = m_renewals.find(row.memory_id, row.fencing_token);
  if (!l) return;
  if (l->expires_at > row.expires_at) row.expires_at = l->expires_at;
  if (l->renewals > 0) {
    row.renewals += l->renewals;
    row.renewed_at = renewed_at_of(*l);
  }
}

void SqliteStore::flush_renewals(Db& db) {
  for (const auto& p : m_renewals.drain()) write_renewal(db, p.memory_id, p.lease);
}

std::optional<lease::Renewed> SqliteStore::renew_from_memory(const Ctx& ctx, const LeaseRef& ref) {
  if (!m_serving) return std::nullopt;
  const UnixMs now = m_clock.now();
  auto r =
      m_renewals.renew(ref.memory_id, ref.fencing_token,
                       m_renewals.tag(ctx.auth.tenant_id, ref.canonical_name, ref.owner_client_id), ref.ttl_s, now);
  if (!r) return std::nullopt;
  if (r->first_pending) {
    {
      std::lock_guard lock(m_mutex);
      m_flush_wanted = true;
    }
    m_cv.notify_one();
  }
  return lease::Renewed{r->expires_at, ref.ttl_s, now};
}

// ---- operations -------------------------------------------------------------------------

void SqliteStore::register_memory(const Ctx& ctx, Idempotency idem, RegisterMemory req, Then<lease::Registered> then) {
  submit<lease::Registered>(
      [this, ctx, idem = std::move(idem), req = std::move(req)](Db& db, UnixMs now) {
        return run_idempotent<lease::Registered>(db, now, ctx, idem, [&]() -> expected<lease::Registered, Problem> {
          std::string id = req.memory_id.value_or(uuid_v7().to_string());
          if (auto m = find_memory(db, id)) {
            if (m->tenant_id != ctx.auth.tenant_id)
              return make_unexpected(Problem(Code::memory_id_taken, "this memory id is taken"));
            return lease::Registered{id, m->created_at, false};
          }
          Use s(db.prepare("INSERT INTO memories(memory_id, tenant_id, fence_counter, created_at) "
                           "VALUES (?1, ?2, 0, ?3)"));
          s->bind(1, id).bind(2, ctx.auth.tenant_id).bind(3, now).run();
          audit(ctx.auth.tenant_id, "MEMORY_REGISTERED", {}, id, std::nullopt);
          return lease::Registered{id, now, true};
        });
      },
      std::move(then), ctx.request_id);
}

expected<lease::Grant, Problem> SqliteStore::op_claim(Db& db, UnixMs now, const Ctx& ctx, const Claim& req) {
  // What the rules need to decide (lease_rules.hpp): the memory and every lease that shares
  // the name, the skeleton or the memory, in one lookup (at most one row per unique column),
  // each settled with its renewals from memory. A claim refused writes nothing.
  rules::ClaimView view;
  view.now = now;
  if (req.name && !rules::check_ttl(req.ttl_s)) {
    view.memory = find_memory(db, req.memory_id);
    if (view.memory && view.memory->tenant_id == ctx.auth.tenant_id) {
      static const std::string conflicts_sql = fmt::format(
          "SELECT {} FROM leases WHERE canonical_name = ?1 OR skeleton = ?2 OR memory_id = ?3", k_lease_cols);
      Use s(db.prepare(conflicts_sql));
      s->bind(1, req.name->canonical_name).bind(2, req.name->skeleton).bind(3, req.memory_id);
      while (s->step()) {
        LeaseRow row = read_lease(*s);
        settle(db, row);
        view.conflicts.push_back(std::move(row));
      }
    }
  }
  rules::WaitingAhead ahead;
  if (m_gate && req.name) ahead = [&] { return m_gate(req.name->skeleton, req.memory_id, req.ticket); };
  rules::ClaimDecision d = rules::decide_claim(ctx, req, view, ahead, uuid_v7().to_string());
  for (const auto& note : d.audit) audit(note);
  if (!d.outcome) return std::move(d.outcome);
  const LeaseRow& l = d.lease;
  for (const auto& e : d.removed) delete_lease(db, e.memory_id);
  for (const auto& e : view.conflicts)
    if (e.expires_at != k_released && e.expires_at <= now) count_lease_end(e, "taken_over", e.expires_at);
  {
    Use s(db.prepare("UPDATE memories SET fence_counter = ?1 WHERE memory_id = ?2"));
    s->bind(1, l.fencing_token).bind(2, l.memory_id).run();
  }
  if (d.in_place) {
    rewrite_lease(db, l, d.in_place->owner_client_id != l.owner_client_id);
  } else {
    static const std::string sql = fmt::format(
        "INSERT INTO leases({}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
        k_lease_cols);
    Use s(db.prepare(sql));
    s->bind(1, l.lease_id)
        .bind(2, l.tenant_id)
        .bind(3, l.canonical_name)
        .bind(4, l.display_name)
        .bind(5, l.skeleton)
        .bind(6, l.memory_id)
        .bind(7, l.fencing_token)
        .bind(8, l.owner_client_id)
        .bind(9, l.ttl_s)
        .bind(10, l.expires_at)
        .bind(11, l.acquired_at)
        .bind(12, l.holder.empty() ? std::nullopt : std::optional<std::string>(l.holder))
        .bind(13, l.granted_at)
        .bind(14, l.renewed_at)
        .bind(15, l.renewals)
        .bind(16, l.hold_until)
        .run();
  }
  {
    Use s(db.prepare("INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version, "
                     "icu_version, first_claimed_at, last_claimed_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7) "
                     "ON CONFLICT(canonical_name) DO UPDATE SET display_name = ?2, skeleton = ?3, tenant_id = ?4, "
                     "unicode_version = ?5, icu_version = ?6, last_claimed_at = ?7 "
                     "WHERE display_name IS NOT ?2 OR skeleton IS NOT ?3 OR tenant_id IS NOT ?4 "
                     "OR unicode_version IS NOT ?5 OR icu_version IS NOT ?6 OR last_claimed_at <= ?7 - ?8"));
    // The history row is rewritten when something in it changes, else at most once per
    // k_name_history_resolution_ms: a name claimed again and again (a re-claim, a
    // claim after a release) then writes no page of agent_names.
    s->bind(1, l.canonical_name)
        .bind(2, l.display_name)
        .bind(3, l.skeleton)
        .bind(4, l.tenant_id)
        .bind(5, unicode_version())
        .bind(6, icu_version())
        .bind(7, now)
        .bind(8, k_name_history_resolution_ms)
        .run();
  }
  return std::move(d.outcome);
}

void SqliteStore::claim(const Ctx& ctx, Idempotency idem, Claim req, Then<lease::Grant> then) {
  submit<lease::Grant>(
      [this, ctx, idem = std::move(idem), req = std::move(req)](Db& db, UnixMs now) {
        return run_idempotent<lease::Grant>(
            db, now, ctx, idem, [&] { return op_claim(db, now, ctx, req); }, req.record_refusal);
      },
      std::move(then), ctx.request_id);
}

expected<lease::Renewed, Problem> SqliteStore::op_renew(Db& db, UnixMs now, const Ctx& ctx, const LeaseRef& ref) {
  if (auto p = rules::check_ttl(ref.ttl_s)) return make_unexpected(std::move(*p));
  auto lease = classify(db, now, ctx, ref.memory_id, ref.fencing_token, Code::lease_not_found);
  if (!lease) return make_unexpected(std::move(lease.error()));
  auto expires = rules::decide_renew(*lease, ref, now);
  if (!expires) return make_unexpected(std::move(expires.error()));
  // A longer TTL is on disk before it is acknowledged: after a reboot, a renewal that
  // was lost is made good with the TTL on disk (anchor_clock).
  if (ref.ttl_s > lease->ttl_s) m_must_sync = true;
  Use s(db.prepare("UPDATE leases SET expires_at = ?1, ttl_seconds = ?2, renewed_at = ?4, renewals = renewals + 1 "
                   "WHERE memory_id = ?3"));
  s->bind(1, *expires).bind(2, ref.ttl_s).bind(3, lease->memory_id).bind(4, now).run();
  // Its next renewals are answered from memory (once this commits).
  if (m_serving)
    m_renewals.stage(lease->memory_id,
                     {lease->fencing_token, ref.ttl_s, *expires,
                      m_renewals.tag(ctx.auth.tenant_id, ref.canonical_name, ref.owner_client_id), lease->hold_until});
  return lease::Renewed{*expires, ref.ttl_s, now};
}

void SqliteStore::renew(const Ctx& ctx, LeaseRef ref, Then<lease::Renewed> then) {
  if (auto r = renew_from_memory(ctx, ref)) return then(Outcome<lease::Renewed>(*r));
  submit<lease::Renewed>([this, ctx, ref = std::move(ref)](
                             Db& db, UnixMs now) { return Outcome<lease::Renewed>(op_renew(db, now, ctx, ref)); },
                         std::move(then), ctx.request_id, /*lazy=*/true);
}

void SqliteStore::renew_batch(const Ctx& ctx, RenewBatch req, Then<lease::RenewBatchResult> then) {
  // The leases renewed from memory are answered in place; the others go to the writer.
  lease::RenewBatchResult out;
  out.results.resize(req.leases.size());
  std::vector<std::size_t> left;
  for (std::size_t i = 0; i < req.leases.size(); ++i) {
    auto& ref = req.leases[i];
    if (ref.owner_client_id.empty()) ref.owner_client_id = req.owner_client_id;
    if (auto r = renew_from_memory(ctx, ref))
      out.results[i] = renew_item(ref.canonical_name, *r);
    else
      left.push_back(i);
  }
  if (left.empty()) return then(Outcome<lease::RenewBatchResult>(std::move(out)));
  submit<lease::RenewBatchResult>(
      [this, ctx, req = std::move(req), out = std::move(out), left = std::move(left)](Db& db, UnixMs now) {
        lease::RenewBatchResult res = out; // a batch may run twice (run_batch)
        for (std::size_t i : left)
          res.results[i] = renew_item(req.leases[i].canonical_name, op_renew(db, now, ctx, req.leases[i]));
        return Outcome<lease::RenewBatchResult>(std::move(res));
      },
      std::move(then), ctx.request_id, /*lazy=*/true);
}

void SqliteStore::release(const Ctx& ctx, LeaseRef ref, Then<Released> then) {
  submit<Released>(
      [this, ctx, ref = std::move(ref)](Db& db, UnixMs now) -> Outcome<Released> {
        auto lease = classify(db, now, ctx, ref.memory_id, ref.fencing_token, Code::lease_not_found);
        if (!lease) {
          if (lease.error().code != Code::lease_expired) return std::move(lease.error());
          // Already released or expired with the current token: idempotent success; an
          // expired row left for the sweeper is released now.
          if (auto row = lease_by_memory(db, ref.memory_id);
              row && row->fencing_token == ref.fencing_token && row->expires_at != k_released) {
            settle(db, *row);
            mark_released(db, row->memory_id);
            audit(row->tenant_id, "LEASE_EXPIRED", row->canonical_name, row->memory_id, row->fencing_token,
                  row->renewals);
            count_lease_end(*row, "expired", row->expires_at);
          }
          return Released{};
        }
        if (lease->canonical_name != ref.canonical_name || lease->owner_client_id != ref.owner_client_id)
          return Problem(Code::lease_not_found, "no lease of this owner under this name");
        mark_released(db, lease->memory_id);
        audit(ctx.auth.tenant_id, "LEASE_RELEASED", lease->canonical_name, lease->memory_id, lease->fencing_token,
              lease->renewals);
        count_lease_end(*lease, "released", now);
        return Released{};
      },
      std::move(then), ctx.request_id);
}

void SqliteStore::verify(const Ctx& ctx, Verify req, Then<lease::Verified> then) {
  submit<lease::Verified>(
      [this, ctx, req = std::move(req)](Db& db, UnixMs now) -> Outcome<lease::Verified> {
        auto lease = classify(db, now, ctx, req.memory_id, req.fencing_token, Code::memory_not_found);
        if (!lease) return std::move(lease.error());
        return lease::Verified{lease->memory_id, lease->fencing_token, lease->canonical_name, lease->expires_at, now};
      },
      std::move(then), ctx.request_id);
}

void SqliteStore::branch(const Ctx& ctx, Idempotency idem, Branch req, Then<lease::Branched> then) {
  submit<lease::Branched>(
      [this, ctx, idem = std::move(idem), req = std::move(req)](Db& db, UnixMs now) {
        return run_idempotent<lease::Branched>(db, now, ctx, idem, [&]() -> expected<lease::Branched, Problem> {
          auto branched = [&](const std::string& id, bool created) {
            return lease::Branched{id, req.parent_memory_id, req.parent_fencing_token, created};
          };
          // A client-minted id makes a retry naturally idempotent, as for POST /v1/memories:
          // the same branch again (own tenant, same parent and token) is 200, even under a
          // new Idempotency-Key and after the parent's lease ended.
          if (req.memory_id) {
            if (auto m = find_memory(db, *req.memory_id)) {
              if (m->tenant_id == ctx.auth.tenant_id && m->parent_memory_id == req.parent_memory_id &&
                  m->branched_at_token == req.parent_fencing_token) {
                return branched(*req.memory_id, false);
              }
              return make_unexpected(Problem(Code::memory_id_taken, "this memory id is taken"));
            }
          }
          auto lease = classify(db, now, ctx, req.parent_memory_id, req.parent_fencing_token, Code::memory_not_found);
          if (!lease) return make_unexpected(std::move(lease.error()));
          std::string id = req.memory_id.value_or(uuid_v7().to_string());
          if (!req.memory_id && find_memory(db, id)) // a client's id was looked up above
            return make_unexpected(Problem(Code::memory_id_taken, "this memory id is taken"));
          Use s(db.prepare("INSERT INTO memories(memory_id, tenant_id, parent_memory_id, "
                           "branched_at_token, fence_counter, created_at) VALUES (?1, ?2, ?3, ?4, 0, ?5)"));
          s->bind(1, id)
              .bind(2, ctx.auth.tenant_id)
              .bind(3, req.parent_memory_id)
              .bind(4, req.parent_fencing_token)
              .bind(5, now)
              .run();
          audit(ctx.auth.tenant_id, "MEMORY_BRANCHED", {}, id, req.parent_fencing_token);
          return branched(id, true);
        });
      },
      std::move(then), ctx.request_id);
}

void SqliteStore::revoke(const Ctx& ctx, Revoke req, Then<Revoked> then) {
  submit<Revoked>(
      [this, ctx, req = std::move(req)](Db& db, UnixMs now) -> Outcome<Revoked> {
        auto lease = lease_by_name(db, req.canonical_name);
        if (lease) settle(db, *lease);
        if (!lease || lease->tenant_id != ctx.auth.tenant_id || lease->expires_at <= now)
          return Problem(Code::lease_not_found, "no live lease under this name");
        delete_lease(db, lease->memory_id);
        // The memory remembers the revocation, so that its holder's next renewal learns why
        // its lease ended (rules::classify); the next grant supersedes the token anyway.
        Use s(db.prepare("UPDATE memories SET revoked_token = ?2, revoke_reason = ?3 WHERE memory_id = ?1"));
        s->bind(1, lease->memory_id)
            .bind(2, lease->fencing_token)
            .bind(3, req.reason.empty() ? std::nullopt : std::optional<std::string>(req.reason))
            .run();
        audit(ctx.auth.tenant_id, "LEASE_REVOKED", lease->canonical_name, lease->memory_id, lease->fencing_token,
              lease->renewals);
        count_lease_end(*lease, "revoked", now);
        return Revoked{lease->canonical_name, lease->memory_id};
      },
      std::move(then), ctx.request_id);
}

// ---- reads --------------------------------------------------------------------------------

void SqliteStore::get_lease(const Ctx& ctx, std::string canonical_name, Then<lease::LeaseInfo> then) {
  read<lease::LeaseInfo>(
      [&](Db& db, UnixMs now) -> Outcome<lease::LeaseInfo> {
        auto lease = lease_by_name(db, canonical_name);
        if (lease) overlay(*lease);
        if (!lease || lease->tenant_id != ctx.auth.tenant_id || lease->expires_at <= now)
          return Problem(Code::lease_not_found, "no live lease of this tenant under this name");
        return to_lease_info(*lease, now);
      },
      then);
}

void SqliteStore::list_leases(const Ctx& ctx, ListLeases req, Then<lease::LeasePage> then) {
  read<lease::LeasePage>(
      [&](Db& db, UnixMs now) -> Outcome<lease::LeasePage> {
        // Two statements, so each is planned onto its index (leases_owner_name or
        // leases_tenant_name) in name order; no name is empty, so "" starts the first page.
        // No LIMIT: rows that ended lately are read too (k_unflushed_margin_ms), and the
        // page stops reading once full.
        static const std::string by_tenant =
            fmt::format("SELECT {} FROM leases WHERE tenant_id = ?1 AND canonical_name > ?3 AND expires_at > ?2 "
                        "ORDER BY canonical_name",
                        k_lease_cols);
        static const std::string by_owner =
            fmt::format("SELECT {} FROM leases WHERE tenant_id = ?1 AND owner_client_id = ?4 AND canonical_name > ?3 "
                        "AND expires_at > ?2 ORDER BY canonical_name",
                        k_lease_cols);
        Use s(db.prepare(req.owner_client_id ? by_owner : by_tenant));
        s->bind(1, ctx.auth.tenant_id)
            .bind(2, std::max<UnixMs>(k_released, now - k_unflushed_margin_ms))
            .bind(3, req.cursor.value_or(""));
        if (req.owner_client_id) s->bind(4, *req.owner_client_id);
        LeasePageBuilder page(req.limit);
        for (bool more = true; more && s->step();) {
          LeaseRow row = read_lease(*s);
          overlay(row);
          if (row.expires_at > now) more = page.add(row, now);
        }
        return page.take();
      },
      then);
}

void SqliteStore::get_memory(const Ctx& ctx, std::string memory_id, Then<lease::Memory> then) {
  read<lease::Memory>(
      [&](Db& db, UnixMs) -> Outcome<lease::Memory> {
        auto m = find_memory(db, memory_id);
        if (!m || m->tenant_id != ctx.auth.tenant_id)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        return to_memory(*m);
      },
      then);
}

void SqliteStore::lineage(const Ctx& ctx, std::string memory_id, Then<lease::Lineage> then) {
  read<lease::Lineage>(
      [&](Db& db, UnixMs) -> Outcome<lease::Lineage> {
        auto m = find_memory(db, memory_id);
        if (!m || m->tenant_id != ctx.auth.tenant_id)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        lease::Lineage out;
        out.memory_id = memory_id;
        out.memory = to_memory(*m);
        std::string parent = m->parent_memory_id.value_or("");
        for (int depth = 0; !parent.empty() && depth < 100000; ++depth) {
          auto p = find_memory(db, parent);
          if (!p || p->tenant_id != ctx.auth.tenant_id) break;
          out.ancestors.push_back(to_memory(*p));
          parent = p->parent_memory_id.value_or("");
        }
        Use s(db.prepare("SELECT memory_id FROM memories WHERE parent_memory_id = ?1 AND tenant_id = ?2 "
                         "ORDER BY memory_id"));
        s->bind(1, memory_id).bind(2, ctx.auth.tenant_id);
        std::vector<std::string> ids;
        while (s->step()) ids.push_back(s->text(0));
        for (const auto& id : ids)
          if (auto c = find_memory(db, id)) out.children.push_back(to_memory(*c));
        return out;
      },
      then);
}

void SqliteStore::history(const Ctx& ctx, HistoryQuery req, Then<lease::HistoryPage> then) {
  read<lease::HistoryPage>(
      [&](Db& db, UnixMs) -> Outcome<lease::HistoryPage> {
        lease::HistoryPage page;
        page.canonical_name = req.canonical_name;
        std::string salt;
        {
          Use q(db.prepare("SELECT audit_salt FROM tenants WHERE tenant_id = ?1"));
          q->bind(1, ctx.auth.tenant_id);
          if (q->step()) salt = q->text(0);
        }
        // Newest first, in rowid order (rows are appended); the cursor is the last rowid
        // of the page before. A scan: the audit table keeps no index (see version 7).
        std::int64_t before = INT64_MAX;
        if (req.cursor) {
          auto c = std::from_chars(req.cursor->data(), req.cursor->data() + req.cursor->size(), before);
          if (c.ec != std::errc() || c.ptr != req.cursor->data() + req.cursor->size())
            return Problem(Code::invalid_request, "cursor is not a next_cursor this server returned");
        }
        Use s(db.prepare("SELECT rowid, event_type, fencing_token, renewals, created_at FROM audit_events "
                         "WHERE tenant_id = ?1 AND redacted_name_hash = ?2 AND created_at >= ?3 AND rowid < ?4 "
                         "ORDER BY rowid DESC LIMIT ?5"));
        s->bind(1, ctx.auth.tenant_id)
            .bind(2, HmacSha256(salt).hex(req.canonical_name))
            .bind(3, req.since.value_or(0))
            .bind(4, before)
            .bind(5, static_cast<std::int64_t>(req.limit) + 1);
        std::int64_t last = 0;
        while (s->step()) {
          if (page.events.size() == req.limit) {
            page.next_cursor = std::to_string(last);
            break;
          }
          last = s->int64(0);
          page.events.push_back(lease::HistoryEvent{s->text(1), s->opt_int64(2), s->opt_int64(3), s->int64(4)});
        }
        return page;
      },
      then);
}

std::vector<std::pair<std::string, std::int64_t>> SqliteStore::active_leases_by_tenant() {
  auto rd = reader();
  Use s(rd.db().prepare("SELECT t.name, count(*) FROM leases l JOIN tenants t ON t.tenant_id = l.tenant_id "
                        "WHERE l.expires_at > ?1 GROUP BY l.tenant_id"));
  s->bind(1, m_clock.now());
  std::vector<std::pair<std::string, std::int64_t>> out;
  while (s->step()) out.emplace_back(s->text(0), s->int64(1));
  return out;
}

std::optional<AuthInfo> SqliteStore::authenticate(const std::string& token_sha256) {
  // Read before the lookup: a revocation committed after it changes the epoch.
  auto epoch = m_tokens.epoch();
  if (auto hit = m_tokens.find(token_sha256, epoch)) return hit;
  auto rd = reader();
  Use s(rd.db().prepare("SELECT token_id, tenant_id, scopes FROM tokens "
                        "WHERE token_sha256 = ?1 AND revoked_at IS NULL"));
  s->bind(1, token_sha256);
  if (!s->step()) return std::nullopt;
  AuthInfo a;
  a.token_id = s->text(0);
  a.tenant_id = s->text(1);
  std::string scopes = s->text(2);
  a.scope_admin = scopes.find("admin") != std::string::npos;
  a.scope_lease = scopes.find("lease") != std::string::npos || a.scope_admin;
  m_tokens.put(token_sha256, a, epoch);
  return a;
}

void SqliteStore::audit_auth_failure(const std::string& tenant_id) {
  enqueue([this, tenant_id](Db&, UnixMs) { audit(tenant_id, "AUTH_FAILED", {}, {}, std::nullopt); },
          [](std::optional<Problem>) {}, {});
}

bool SqliteStore::ready() {
  if (!m_healthy) {
    // A failed commit marks the store unhealthy until a write succeeds again; probe with
    // a durable write to the database itself (a full disk fails it; a TEMP table would not).
    try {
      run_sync<int>([](Db& db, UnixMs now) {
        Use s(db.prepare("INSERT INTO settings(key, value) VALUES ('readiness_probe', ?1) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value"));
        s->bind(1, std::to_string(now)).run();
        return 0;
      });
    } catch (...) {}
    if (!m_healthy) return false;
  }
  try {
    auto rd = reader();
    Use s(rd.db().prepare("SELECT 1"));
    return s->step();
  } catch (...) {
    return false;
  }
}

std::int64_t SqliteStore::active_leases() {
  auto rd = reader();
  Use s(rd.db().prepare("SELECT count(*) FROM leases WHERE expires_at > ?1"));
  s->bind(1, m_clock.now());
  return s->step() ? s->int64(0) : 0;
}

void SqliteStore::refresh_migration_state(Db& db) {
  Use s(db.prepare("SELECT value FROM settings WHERE key = 'migration_state'"));
  m_migration_in_progress = s->step() && s->text(0) == "in-progress";
}

bool SqliteStore::migration_in_progress() { return m_migration_in_progress; }

void SqliteStore::identity_map(const Ctx& ctx, std::optional<std::string> cursor, std::size_t limit,
                               Then<lease::IdentityMapPage> then) {
  read<lease::IdentityMapPage>(
      [&](Db& db, UnixMs) -> Outcome<lease::IdentityMapPage> {
        Use s(db.prepare("SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map "
                         "WHERE tenant_id = ?1 AND (?2 IS NULL OR legacy_memory_ref > ?2) "
                         "ORDER BY legacy_memory_ref LIMIT ?3"));
        s->bind(1, ctx.auth.tenant_id).bind(2, cursor).bind(3, static_cast<std::int64_t>(limit + 1));
        lease::IdentityMapPage page;
        while (s->step()) {
          if (page.entries.size() == limit) {
            page.next_cursor = page.entries.back().legacy_memory_ref;
            break;
          }
          page.entries.push_back(lease::IdentityEntry{s->text(0), s->text(1)});
        }
        return page;
      },
      then);
}

std::int64_t SqliteStore::sweep() {
  return run_sync<std::int64_t>([this](Db& db, UnixMs now) {
    refresh_migration_state(db);
    save_clock_checkpoint(db, m_flushed_at);
    Metrics::global().set("mep_sqlite_renewals_from_memory_total", static_cast<double>(m_renewals.renewals()));
    std::int64_t removed = 0;
    std::vector<LeaseRow> expired;
    {
      static const std::string sql =
          fmt::format("SELECT {} FROM leases WHERE expires_at <= ?1 LIMIT {}", k_lease_cols, k_sweep_batch);
      Use s(db.prepare(sql));
      s->bind(1, now);
      while (s->step()) expired.push_back(read_lease(*s));
    }
    for (auto& e : expired) {
      settle(db, e);
      if (e.expires_at > now) continue; // renewed from memory
      delete_lease(db, e.memory_id);
      if (e.expires_at != k_released) {
        audit(e.tenant_id, "LEASE_EXPIRED", e.canonical_name, e.memory_id, e.fencing_token, e.renewals);
        count_lease_end(e, "expired", e.expires_at);
      }
      ++removed;
    }
    // Idempotency records expire in the order they were written (the retention is fixed),
    // so the expired ones are the oldest rowids: read from the first, stop at a live one.
    // (A clock stepped back only delays the records written after the step.)
    std::optional<std::int64_t> last_expired;
    {
      Use s(db.prepare("SELECT rowid, expires_at FROM idempotency ORDER BY rowid LIMIT 5000"));
      while (s->step() && s->int64(1) <= now) last_expired = s->int64(0);
    }
    if (last_expired) {
      Use s(db.prepare("DELETE FROM idempotency WHERE rowid <= ?1 AND expires_at <= ?2"));
      s->bind(1, *last_expired).bind(2, now).run();
      removed += db.changes();
    }
    return removed;
  });
}

// ---- administration -------------------------------------------------------------------------

std::pair<std::string, std::string> SqliteStore::create_token(const std::string& tenant_name, Scope scope) {
  return run_sync<std::pair<std::string, std::string>>([&](Db& db, UnixMs now) {
    std::string tenant_id;
    {
      Use s(db.prepare("SELECT tenant_id FROM tenants WHERE name = ?1"));
      s->bind(1, tenant_name);
      if (s->step()) tenant_id = s->text(0);
    }
    if (tenant_id.empty()) {
      tenant_id = uuid_v7().to_string();
      std::string salt = random_hex(32);
      Use s(db.prepare("INSERT INTO tenants(tenant_id, name, audit_salt, created_at) VALUES (?1, ?2, ?3, ?4)"));
      s->bind(1, tenant_id).bind(2, tenant_name).bind(3, salt).bind(4, now).run();
    }
    std::string token = "mep_" + random_hex(32);
    Use s(db.prepare("INSERT INTO tokens(token_id, tenant_id, token_sha256, scopes, created_at) "
                     "VALUES (?1, ?2, ?3, ?4, ?5)"));
    s->bind(1, uuid_v7().to_string())
        .bind(2, tenant_id)
        .bind(3, sha256_hex(token))
        .bind(4, scope == Scope::admin ? "lease admin" : "lease")
        .bind(5, now)
        .run();
    return std::make_pair(tenant_id, token);
  });
}

std::vector<TokenInfo> SqliteStore::list_tokens(const std::optional<std::string>& tenant_name) {
  auto rd = reader();
  Use s(rd.db().prepare("SELECT t.token_id, t.tenant_id, n.name, t.scopes, t.created_at, t.revoked_at "
                        "FROM tokens t JOIN tenants n ON n.tenant_id = t.tenant_id "
                        "WHERE ?1 IS NULL OR n.name = ?1 ORDER BY t.token_id"));
  s->bind(1, tenant_name);
  std::vector<TokenInfo> out;
  while (s->step())
    out.push_back(TokenInfo{s->text(0), s->text(1), s->text(2), s->text(3), s->int64(4), s->opt_int64(5)});
  return out;
}

bool SqliteStore::revoke_token(const std::string& token_id) {
  bool revoked = run_sync<bool>([&](Db& db, UnixMs now) {
    Use s(db.prepare("UPDATE tokens SET revoked_at = ?1 WHERE token_id = ?2 AND revoked_at IS NULL"));
    s->bind(1, now).bind(2, token_id).run();
    return db.changes() > 0;
  });
  // After the commit: a server that sees the new epoch looks the token up again and finds
  // it revoked. Without the epoch file, servers drop their entries within a second.
  if (revoked && !m_tokens.invalidate())
    log::warn("cannot update {}-token-epoch; a running server may accept the token for up to 1 s",
              std::filesystem::path(m_path).filename().string());
  return revoked;
}

std::vector<AuditRow> SqliteStore::list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) {
  auto rd = reader();
  Use s(rd.db().prepare("SELECT a.event_id, a.tenant_id, a.event_type, a.redacted_name_hash, "
                        "a.redacted_memory_hash, a.fencing_token, a.created_at FROM audit_events a "
                        "LEFT JOIN tenants n ON n.tenant_id = a.tenant_id "
                        "WHERE ?1 IS NULL OR n.name = ?1 ORDER BY a.rowid DESC LIMIT ?2"));
  s->bind(1, tenant_name).bind(2, static_cast<std::int64_t>(limit));
  std::vector<AuditRow> out;
  while (s->step())
    out.push_back(AuditRow{s->text(0), s->text(1), s->text(2), s->text(3), s->text(4), s->opt_int64(5), s->int64(6)});
  return out;
}

} // namespace mep::server
