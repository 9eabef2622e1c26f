// The SQLite schema, one constant per version, and the upgrade that runs every version
// above the database's own in one transaction (SqliteStore::migrate).
#include "internal.hpp"

#include <cstdint>

namespace mep::server {
namespace {

using sqlite::Db;
using sqlite::Use;

constexpr int k_schema_version = 10;

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

} // namespace

int sqlite_schema_version() { return k_schema_version; }

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

} // namespace mep::server
