-- Version 1: tenants, tokens, memories, leases, names, idempotency records, audit events,
-- settings and the migration's tables; the claim, renew, release, verify and register
-- functions. See README.md for why the lease operations are functions.
CREATE TABLE IF NOT EXISTS tenants (
  tenant_id   TEXT PRIMARY KEY,
  name        TEXT NOT NULL UNIQUE,
  audit_salt  TEXT NOT NULL,
  audit_ipad  BYTEA NOT NULL,
  audit_opad  BYTEA NOT NULL,
  created_at  BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
  token_id     TEXT PRIMARY KEY,
  tenant_id    TEXT NOT NULL REFERENCES tenants(tenant_id),
  token_sha256 TEXT NOT NULL UNIQUE,
  scopes       TEXT NOT NULL,
  created_at   BIGINT NOT NULL,
  revoked_at   BIGINT
);
CREATE TABLE IF NOT EXISTS memories (
  memory_id          TEXT PRIMARY KEY,
  tenant_id          TEXT NOT NULL,
  parent_memory_id   TEXT,
  branched_at_token  BIGINT,
  fence_counter      BIGINT NOT NULL DEFAULT 0,
  created_at         BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS memories_parent ON memories(parent_memory_id);
CREATE TABLE IF NOT EXISTS leases (
  lease_id         TEXT PRIMARY KEY,
  tenant_id        TEXT NOT NULL,
  canonical_name   TEXT NOT NULL UNIQUE,
  display_name     TEXT NOT NULL,
  skeleton         TEXT NOT NULL UNIQUE,
  memory_id        TEXT NOT NULL UNIQUE,
  fencing_token    BIGINT NOT NULL,
  owner_client_id  TEXT NOT NULL,
  ttl_seconds      BIGINT NOT NULL,
  expires_at       BIGINT NOT NULL,
  acquired_at      BIGINT NOT NULL
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
  first_claimed_at BIGINT NOT NULL,
  last_claimed_at  BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
  tenant_id    TEXT NOT NULL,
  idem_key     TEXT NOT NULL,
  fingerprint  TEXT NOT NULL,
  status       INTEGER NOT NULL,
  body         TEXT NOT NULL,
  created_at   BIGINT NOT NULL,
  expires_at   BIGINT NOT NULL,
  PRIMARY KEY (tenant_id, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency(expires_at);
CREATE TABLE IF NOT EXISTS audit_events (
  event_id              TEXT PRIMARY KEY,
  tenant_id             TEXT NOT NULL,
  event_type            TEXT NOT NULL,
  redacted_name_hash    TEXT NOT NULL,
  redacted_memory_hash  TEXT NOT NULL,
  fencing_token         BIGINT,
  created_at            BIGINT NOT NULL
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
  migrated_at        BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS migration_identity_map (
  tenant_id          TEXT NOT NULL,
  legacy_memory_ref  TEXT NOT NULL,
  memory_instance_id TEXT NOT NULL,
  PRIMARY KEY (tenant_id, legacy_memory_ref)
);

-- The database clock, in Unix milliseconds: the only clock of this backend. It is the
-- wall clock at the call (clock_timestamp), not the transaction's start (now()): a claim
-- that waited for a lock must decide expiry, and stamp its grant, at the time it acts, or
-- the order of server times would not be the order in which grants happened.
CREATE OR REPLACE FUNCTION mep_now_ms() RETURNS bigint LANGUAGE sql VOLATILE AS $$
  SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint
$$;

-- A UUIDv7 (RFC 9562) for the Unix millisecond p_ms. (Helpers that run statements are
-- PL/pgSQL, whose plans are cached per session: a non-inlined SQL function is planned again
-- on every call, which tripled the cost of a claim.)
CREATE OR REPLACE FUNCTION mep_uuid7(p_ms bigint) RETURNS text LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  h text := lpad(to_hex(p_ms), 12, '0');
  r text := gen_random_uuid()::text;
BEGIN
  RETURN substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 16, 3) || '-' ||
         substr(r, 20, 4) || '-' || substr(r, 25, 12);
END
$$;

-- Seconds until p_expires, rounded up, at least 1 (Retry-After).
CREATE OR REPLACE FUNCTION mep_retry_after(p_expires bigint, p_now bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
  SELECT greatest(1, (p_expires - p_now + 999) / 1000)
$$;

-- HMAC-SHA256 of p_text under the tenant's salt, in hex ('' for no text):
-- sha256(opad || sha256(ipad || text)) with the padded keys stored with the tenant (a tenant
-- that does not exist hashes under the empty key).
CREATE OR REPLACE FUNCTION mep_hash(p_tenant text, p_text text) RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
  v_ipad bytea;
  v_opad bytea;
BEGIN
  IF p_text IS NULL OR p_text = '' THEN
    RETURN '';
  END IF;
  SELECT audit_ipad, audit_opad INTO v_ipad, v_opad FROM tenants WHERE tenant_id = p_tenant;
  IF v_ipad IS NULL THEN
    v_ipad := decode(repeat('36', 64), 'hex');
    v_opad := decode(repeat('5c', 64), 'hex');
  END IF;
  RETURN encode(sha256(v_opad || sha256(v_ipad || convert_to(p_text, 'UTF8'))), 'hex');
END
$$;

-- mep_audit, one audit row (names and memory ids hashed): see v7.

-- mep_audit_many, audit rows for a JSON array of leases: see v7.

-- A problem as the server renders it: code, detail, instance (the request id).
CREATE OR REPLACE FUNCTION mep_problem(p_code text, p_detail text, p_request_id text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
  SELECT jsonb_build_object('code', p_code, 'detail', p_detail, 'instance', p_request_id)
$$;

-- Creating calls answer {status, replayed, result}; `result` is what the body is rendered
-- from, the first time and on every replay.
--
-- mep_idem_begin claims an Idempotency-Key for this call and returns NULL, or answers from
-- the key: the stored outcome (replayed) or 422 for another request under the same key.
CREATE OR REPLACE FUNCTION mep_idem_begin(p_tenant text, p_key text, p_fp text, p_now bigint,
                                          p_request_id text) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_claimed text;
  v_fp text;
  v_status integer;
  v_body text;
BEGIN
  INSERT INTO idempotency AS i (tenant_id, idem_key, fingerprint, status, body, created_at, expires_at)
  VALUES (p_tenant, p_key, p_fp, 0, '', p_now, p_now + 86400000)
  ON CONFLICT (tenant_id, idem_key) DO UPDATE
    SET fingerprint = excluded.fingerprint, status = 0, body = '',
        created_at = excluded.created_at, expires_at = excluded.expires_at
    WHERE i.expires_at <= p_now
  RETURNING i.idem_key INTO v_claimed;
  IF v_claimed IS NOT NULL THEN
    RETURN NULL;
  END IF;
  SELECT i.fingerprint, i.status, i.body INTO v_fp, v_status, v_body
    FROM idempotency i WHERE i.tenant_id = p_tenant AND i.idem_key = p_key;
  IF v_fp IS DISTINCT FROM p_fp THEN
    RETURN jsonb_build_object('status', 422, 'replayed', false, 'result',
             mep_problem('idempotency-key-reused', 'this Idempotency-Key was used with a different request',
                         p_request_id));
  END IF;
  RETURN jsonb_build_object('status', v_status, 'replayed', true, 'result', v_body::jsonb);
END
$$;

-- Stores the outcome under the key claimed by mep_idem_begin and returns the answer.
CREATE OR REPLACE FUNCTION mep_idem_end(p_tenant text, p_key text, p_status integer, p_result jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
  UPDATE idempotency SET status = p_status, body = p_result::text
   WHERE tenant_id = p_tenant AND idem_key = p_key;
  RETURN jsonb_build_object('status', p_status, 'replayed', false, 'result', p_result);
END
$$;

-- Functions whose newest version replaced them whole are defined only there: a database is
-- migrated from its version to the newest in one transaction (PgStore::migrate), so a
-- version before the newest is never seen on its own.
-- mep_classify, what a presented (memory, token) refers to: see v6.

-- mep_claim, the atomic claim of SPEC §6.1: see v6.

-- mep_renew_one, the renewal of one lease: see v8.

-- mep_renew and mep_renew_batch, a lease's and many leases' renewal: see v8.

-- mep_release: see v6.

-- mep_verify, whether a token's lease is live (POST /v1/fence/verify): see v8.

CREATE OR REPLACE FUNCTION mep_register(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_memory text) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_hit jsonb;
  v_inserted text;
  v_tenant text;
  v_created bigint;
  v_n integer;
BEGIN
  v_hit := mep_idem_begin(p_tenant, p_key, p_fp, v_now, p_request_id);
  IF v_hit IS NOT NULL THEN
    RETURN v_hit;
  END IF;
  INSERT INTO memories(memory_id, tenant_id, fence_counter, created_at)
  VALUES (p_memory, p_tenant, 0, v_now) ON CONFLICT (memory_id) DO NOTHING
  RETURNING memory_id INTO v_inserted;
  IF v_inserted IS NOT NULL THEN
    v_n := mep_audit(p_tenant, 'MEMORY_REGISTERED', NULL, p_memory, NULL, v_now);
    RETURN mep_idem_end(p_tenant, p_key, 201,
                        jsonb_build_object('memory_instance_id', p_memory, 'created_at', v_now));
  END IF;
  SELECT tenant_id, created_at INTO v_tenant, v_created FROM memories WHERE memory_id = p_memory;
  IF v_tenant IS DISTINCT FROM p_tenant THEN
    RETURN mep_idem_end(p_tenant, p_key, 409, mep_problem('memory-id-taken', 'this memory id is taken', p_request_id));
  END IF;
  RETURN mep_idem_end(p_tenant, p_key, 200, jsonb_build_object('memory_instance_id', p_memory, 'created_at', v_created));
END
$$;

-- mep_revoke: see v4.

-- mep_sweep, the sweeper: see v6.
