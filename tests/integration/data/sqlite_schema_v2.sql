-- The SQLite schema at version 2, exactly as mep wrote it before version 3 (frozen: the
-- upgrade test builds an old database from it; never edit it to follow the new schema).
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
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
INSERT INTO schema_version(version) VALUES (1);
INSERT INTO schema_version(version) VALUES (2);
