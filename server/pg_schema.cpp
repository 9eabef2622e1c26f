// The PostgreSQL schema (version 1) and the server-side functions through which every
// lease operation is one statement, one round trip and one transaction (SPEC §9).
//
// Why functions: a claim is eight steps with branches (idempotency, memory, takeover, name,
// skeleton, memory attachment, grant, history, audit). As a PL/pgSQL function the whole of
// it runs in one call, rolls back as a whole on any error, and sees each of its own steps.
//
// The PL/pgSQL stays inside what CockroachDB's implementation accepts (see the README):
// scalar variables only (no RECORD), SELECT/RETURNING … INTO and IS NULL tests instead of
// FOUND, no FOR loops, no PERFORM, no GET DIAGNOSTICS; set work is done in SQL (CTEs).
//
// Race-freedom under READ COMMITTED (each statement of a function takes a fresh snapshot):
// * A claim locks its memory row (SELECT … FOR UPDATE) first: claims of one memory run one
//   at a time, so the fence counter is read and bumped under a lock and never issued twice.
// * Name and skeleton are guarded by the UNIQUE constraints of `leases`. The grant inserts
//   with ON CONFLICT DO NOTHING, which waits for a concurrent inserter; when that one commits
//   the insert does nothing, and the loop looks again (a new snapshot) and answers 423.
// * Renew and release are single UPDATE/DELETE statements whose WHERE clause names the
//   fencing token and the expiry; a row changed under them is re-checked (EvalPlanQual).
// * Idempotency keys are claimed by inserting the key row first (ON CONFLICT … DO UPDATE …
//   WHERE expired): a concurrent duplicate waits on that row and then replays its outcome.
// Under SERIALIZABLE the same functions run; conflicts surface as 40001 and the server
// retries the whole call.
//
// Audit hashes are HMAC-SHA256 under the tenant's salt. The salt's inner and outer padded
// keys are stored with the tenant, so HMAC is two sha256() calls and no XOR in SQL. Since v7
// the server computes a claim's hashes itself and a lease row keeps them (see v7). Audit
// rows are written in the same transaction as the operation they record.
#include <string_view>

namespace mep::server {

extern const std::string_view k_pg_schema_v1;
extern const std::string_view k_pg_schema_v2;
extern const std::string_view k_pg_schema_v3;
extern const std::string_view k_pg_schema_v4;
extern const std::string_view k_pg_schema_v5;
extern const std::string_view k_pg_schema_v6;
extern const std::string_view k_pg_schema_v7;
extern const std::string_view k_pg_schema_v8;
extern const std::string_view k_pg_schema_v9;
extern const std::string_view k_pg_schema_v10;
extern const std::string_view k_pg_schema_v11;
extern const std::string_view k_pg_schema_v12;

const std::string_view k_pg_schema_v1 = R"sql(
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
)sql";

// Version 2: listings page through an index in name order (the (tenant, owner) index made
// every page sort all of the tenant's leases).
const std::string_view k_pg_schema_v2 = R"sql(
DROP INDEX IF EXISTS leases_owner;
CREATE INDEX IF NOT EXISTS leases_owner_name ON leases(tenant_id, owner_client_id, canonical_name);
CREATE INDEX IF NOT EXISTS leases_tenant_name ON leases(tenant_id, canonical_name);
)sql";

// Version 3: branching. mep_branch (created here, not in version 1) answers 200 to the same
// branch made again with the client's memory id (own tenant, same parent and token).
const std::string_view k_pg_schema_v3 = R"sql(
CREATE OR REPLACE FUNCTION mep_branch(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_parent text, p_token bigint, p_memory text) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_hit jsonb;
  v_problem jsonb;
  v_inserted text;
  v_owner text;
  v_parent text;
  v_at bigint;
  v_n integer;
BEGIN
  v_hit := mep_idem_begin(p_tenant, p_key, p_fp, v_now, p_request_id);
  IF v_hit IS NOT NULL THEN
    RETURN v_hit;
  END IF;
  -- The same branch again (own tenant, same parent and token): 200, as for a memory id
  -- registered again, even after the parent's lease ended.
  SELECT tenant_id, parent_memory_id, branched_at_token INTO v_owner, v_parent, v_at
    FROM memories WHERE memory_id = p_memory;
  IF v_owner IS NOT NULL THEN
    IF v_owner = p_tenant AND v_parent IS NOT NULL AND v_parent = p_parent AND v_at IS NOT NULL
       AND v_at = p_token THEN
      RETURN mep_idem_end(p_tenant, p_key, 200,
               jsonb_build_object('memory_instance_id', p_memory, 'parent_memory_instance_id', p_parent,
                                  'branched_at_token', p_token, 'outcome', 'branched'));
    END IF;
    RETURN mep_idem_end(p_tenant, p_key, 409, mep_problem('memory-id-taken', 'this memory id is taken', p_request_id));
  END IF;
  v_problem := mep_classify(p_tenant, p_parent, p_token, v_now, 'memory-not-found', p_request_id);
  IF v_problem IS NOT NULL THEN
    RETURN mep_idem_end(p_tenant, p_key, 400, v_problem);
  END IF;
  INSERT INTO memories(memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at)
  VALUES (p_memory, p_tenant, p_parent, p_token, 0, v_now) ON CONFLICT (memory_id) DO NOTHING
  RETURNING memory_id INTO v_inserted;
  IF v_inserted IS NULL THEN
    RETURN mep_idem_end(p_tenant, p_key, 409, mep_problem('memory-id-taken', 'this memory id is taken', p_request_id));
  END IF;
  v_n := mep_audit(p_tenant, 'MEMORY_BRANCHED', NULL, p_memory, p_token, v_now);
  RETURN mep_idem_end(p_tenant, p_key, 201,
           jsonb_build_object('memory_instance_id', p_memory, 'parent_memory_instance_id', p_parent,
                              'branched_at_token', p_token, 'outcome', 'branched'));
END
$$;
)sql";

// v4: a revocation says which memory it freed, and tells every server (LISTEN
// mep_lease_freed) the name and the memory itself, in its transaction and only when it
// revoked something: claims waiting for that memory under another name wake too.
const std::string_view k_pg_schema_v4 = R"sql(
CREATE OR REPLACE FUNCTION mep_revoke(p_tenant text, p_name text, p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_name text;
  v_memory text;
  v_token bigint;
  v_n integer;
BEGIN
  DELETE FROM leases WHERE canonical_name = p_name AND tenant_id = p_tenant AND expires_at > v_now
  RETURNING canonical_name, memory_id, fencing_token INTO v_name, v_memory, v_token;
  IF v_name IS NULL THEN
    RETURN mep_problem('lease-not-found', 'no live lease under this name', p_request_id);
  END IF;
  v_n := mep_audit(p_tenant, 'LEASE_REVOKED', v_name, v_memory, v_token, v_now);
  PERFORM pg_notify('mep_lease_freed', v_name || chr(9) || v_memory);
  RETURN jsonb_build_object('outcome', 'revoked', 'canonical_name', v_name, 'memory_instance_id', v_memory);
END
$$;
)sql";

// v5: one queue of waiting claims for all the servers on the database (Prefer: wait).
// A waiting claim takes a ticket, a row of mep_waiters, when it starts to wait; tickets
// are in order of arrival. A claim is refused (423) while an earlier ticket, or for a
// claim that does not wait any ticket, waits for its skeleton or memory (in mep_claim).
// A ticket counts while its server keeps it alive (alive_until, renewed every second), so
// the tickets of a server that died hold no one up for more than a few seconds. The claim
// functions of v1 and v4 take the ticket as a new last parameter; their old forms stay, as
// claims without a ticket, for earlier servers that run on during a rolling upgrade.
const std::string_view k_pg_schema_v5 = R"sql(
CREATE TABLE IF NOT EXISTS mep_waiters (
  waiter_id      BIGSERIAL PRIMARY KEY,
  tenant_id      TEXT NOT NULL,
  canonical_name TEXT NOT NULL,
  skeleton       TEXT NOT NULL,
  memory_id      TEXT NOT NULL,
  alive_until    BIGINT NOT NULL,
  abandoned      BOOLEAN NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS mep_waiters_skeleton ON mep_waiters(skeleton, waiter_id);
CREATE INDEX IF NOT EXISTS mep_waiters_memory ON mep_waiters(memory_id, waiter_id);
CREATE INDEX IF NOT EXISTS mep_waiters_alive ON mep_waiters(alive_until);

-- A refusal's count of the live claims waiting for the skeleton or the memory ahead of
-- p_ticket (NULL: all of them), on every server: {"ext": {"waiters": n}}, or {} for none.
CREATE OR REPLACE FUNCTION mep_wait_ext(p_skeleton text, p_memory text, p_ticket bigint, p_now bigint)
RETURNS jsonb LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN count(*) = 0 THEN '{}'::jsonb
              ELSE jsonb_build_object('ext', jsonb_build_object('waiters', count(*))) END
    FROM mep_waiters
   WHERE (skeleton = p_skeleton OR memory_id = p_memory) AND (p_ticket IS NULL OR waiter_id < p_ticket)
     AND NOT abandoned AND alive_until > p_now
$$;

-- SPEC §6.1: the atomic claim, with p_ticket: the claim's place in the queue of waiting
-- claims (mep_waiters), NULL for a claim that does not wait. Its body is v6's (with the
-- clock's bound); v5 is only ever applied just before v6. (PL/pgSQL, whose body is not
-- resolved before its first call: the function it calls comes with v6.)
CREATE OR REPLACE FUNCTION mep_claim(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
  RETURN mep_claim(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                   p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket, NULL::bigint);
END
$$;

-- A waiting claim's attempt (Prefer: wait): mep_claim, except that a refusal because the
-- name or the memory is held (423) is not kept under the Idempotency-Key, so the next
-- attempt under the same key runs again instead of replaying it. Every other outcome is
-- kept. One call, one transaction.
CREATE OR REPLACE FUNCTION mep_claim_attempt(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v jsonb;
BEGIN
  v := mep_claim(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                 p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket);
  IF (v->>'status')::integer = 423 AND NOT (v->>'replayed')::boolean THEN
    DELETE FROM idempotency WHERE tenant_id = p_tenant AND idem_key = p_key AND status = 423;
  END IF;
  RETURN v;
END
$$;

-- The claim functions of v1 and v4, kept for servers of an earlier version that still run
-- during a rolling upgrade: claims that do not wait (their own waiters queue only there).
CREATE OR REPLACE FUNCTION mep_claim(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text) RETURNS jsonb
LANGUAGE sql AS $$
  SELECT mep_claim(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                   p_owner, p_ttl, p_lease_id, p_unicode, p_icu, NULL::bigint)
$$;
CREATE OR REPLACE FUNCTION mep_claim_attempt(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text) RETURNS jsonb
LANGUAGE sql AS $$
  SELECT mep_claim_attempt(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                           p_owner, p_ttl, p_lease_id, p_unicode, p_icu, NULL::bigint)
$$;
)sql";

// Version 6: wall-clock steps of the database's clock (SPEC §9, issue 21). This backend's
// lease clock is the database's wall clock, which an NTP step moves. Each server reads it
// every second against its own monotonic clock (PgStore's ClockWatch):
// * a claim carries the latest time the database clock can honestly read (p_bound: the
//   server's last reading advanced by its monotonic clock, plus a tolerance), and decides
//   expiry for takeovers at the lesser of the two, so a forward step is harmless from the
//   instant it happens;
// * the server that finds a forward step records it in mep_clock_steps, and a lease that
//   expired inside a recorded step is held back from takeovers for one TTL after the step
//   (Chubby's lock-delay) while its holder can still renew it. A backward step only makes
//   leases outlive their TTL by its size; it is counted and logged.
const std::string_view k_pg_schema_v6 = R"sql(
CREATE TABLE IF NOT EXISTS mep_clock_steps (
  from_ms BIGINT NOT NULL, -- what the clock should have read (a server's monotonic clock)
  to_ms   BIGINT NOT NULL, -- what it read
  PRIMARY KEY (to_ms, from_ms)
);

-- True while a lease that expired at p_expires, inside a forward step of the clock, is held
-- back: until one TTL after the step. (Steps are few and recent: the table stays tiny.)
CREATE OR REPLACE FUNCTION mep_step_held(p_expires bigint, p_ttl bigint, p_now bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT EXISTS (SELECT 1 FROM mep_clock_steps
                  WHERE from_ms < p_expires AND p_expires <= to_ms AND p_now < to_ms + p_ttl * 1000)
$$;

-- What a presented (memory, token) refers to: NULL when the token is the memory's current
-- grant and its lease is live; else the problem (p_not_found when the memory is not the
-- tenant's, stale-fence when a newer grant exists or the token was never issued,
-- lease-expired when this grant has ended). A lease held back by a step is still its
-- holder's: renewed, released, verified as live.
CREATE OR REPLACE FUNCTION mep_classify(p_tenant text, p_memory text, p_token bigint, p_now bigint,
                                        p_not_found text, p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_tenant text;
  v_counter bigint;
  v_token bigint;
  v_expires bigint;
  v_ttl bigint;
  v_n integer;
BEGIN
  SELECT tenant_id, fence_counter INTO v_tenant, v_counter FROM memories WHERE memory_id = p_memory;
  IF v_tenant IS DISTINCT FROM p_tenant THEN
    RETURN mep_problem(p_not_found, 'no such memory for this tenant', p_request_id);
  END IF;
  IF p_token <> v_counter THEN
    v_n := mep_audit(p_tenant, 'STALE_FENCE_REJECTED', NULL, p_memory, p_token, p_now);
    IF p_token < v_counter THEN
      RETURN mep_problem('stale-fence', format('fencing token %s was superseded by %s', p_token, v_counter),
                         p_request_id)
             || jsonb_build_object('ext', jsonb_build_object('current_fencing_token', v_counter));
    END IF;
    RETURN mep_problem('stale-fence', format('fencing token %s was never issued for this memory', p_token),
                       p_request_id)
           || jsonb_build_object('ext', jsonb_build_object('current_fencing_token', v_counter));
  END IF;
  SELECT fencing_token, expires_at, ttl_seconds INTO v_token, v_expires, v_ttl FROM leases WHERE memory_id = p_memory;
  IF v_token IS NULL OR v_token <> p_token OR (v_expires <= p_now AND NOT mep_step_held(v_expires, v_ttl, p_now)) THEN
    RETURN mep_problem('lease-expired', format('the lease with fencing token %s has ended', p_token),
                       p_request_id);
  END IF;
  RETURN NULL;
END
$$;

-- mep_renew_one, the renewal of one lease, with the clock's bound: see v8.

-- mep_release, mep_sweep, mep_claim and mep_claim_attempt, with the clock's bound and the
-- steps: see v7.
)sql";

// Version 7: a claim costs PostgreSQL half the CPU (issue 22). What v6's claim spent its
// time on, by pg_stat_statements: HMAC-SHA256 and UUIDv7 computed in PL/pgSQL for every
// audit row, an idempotency row inserted first and updated at the end, a takeover DELETE
// and two audit inserts run on every claim with nothing to take over, three lookups of the
// same one to three lease rows, and a re-claim that deleted and re-inserted its own row.
// * The server computes the audit hashes and the event id of a claim (it caches each
//   tenant's salt) and passes them in (p_event, p_name_hash, p_memory_hash). A lease row
//   keeps the hashes of its name and memory (name_hash, memory_hash), so the audit rows of
//   its expiry, takeover and release copy them instead of hashing again. Rows without them
//   (granted before v7, or by a server of an earlier version) are hashed in SQL as before.
// * The Idempotency-Key is looked up first and written once, with the outcome, at the end
//   (mep_idem_put). A concurrent duplicate that committed in between makes that insert find
//   the key taken: the call rolls back (40001), the server runs it again, and it replays
//   the stored outcome. So still one outcome per key, and no effect from a duplicate.
// * One SELECT of the rows that share the name, the skeleton or the memory answers what the
//   three lookups answered; the takeover DELETE runs only when one of them has expired.
// * A re-claim updates its own row in place (the memory's lock keeps other claims out; a
//   concurrent release of the row makes the update find nothing, and the loop looks again).
// The v6 signatures stay, for servers of an earlier version during a rolling upgrade.
const std::string_view k_pg_schema_v7 = R"sql(
ALTER TABLE leases ADD COLUMN IF NOT EXISTS name_hash TEXT;
ALTER TABLE leases ADD COLUMN IF NOT EXISTS memory_hash TEXT;
DROP INDEX IF EXISTS leases_expiry;
ALTER TABLE leases SET (fillfactor = 80);

-- Audit rows for leases given as a JSON array of {tenant, n (name), m (memory), t (token),
-- nh, mh (the lease row's stored hashes, when it has them)}; p_tenant, when given, is the
-- tenant of every row (and the stored hashes count only for rows of that tenant, whose salt
-- made them). Returns how many.
CREATE OR REPLACE FUNCTION mep_audit_many(p_rows jsonb, p_type text, p_tenant text, p_now bigint)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
  v_n integer;
BEGIN
  WITH ins AS (
    INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash,
                             redacted_memory_hash, fencing_token, created_at)
    SELECT mep_uuid7(p_now), coalesce(p_tenant, e->>'tenant'), p_type,
           coalesce(CASE WHEN coalesce(p_tenant, e->>'tenant') = e->>'tenant' THEN e->>'nh' END,
                    mep_hash(coalesce(p_tenant, e->>'tenant'), e->>'n')),
           coalesce(CASE WHEN coalesce(p_tenant, e->>'tenant') = e->>'tenant' THEN e->>'mh' END,
                    mep_hash(coalesce(p_tenant, e->>'tenant'), e->>'m')),
           (e->>'t')::bigint, p_now
      FROM jsonb_array_elements(p_rows) AS e
    RETURNING 1)
  SELECT count(*) INTO v_n FROM ins;
  RETURN v_n;
END
$$;

-- One audit row of a lease whose hashes may be known (p_nh, p_mh: NULL to hash p_name and
-- p_memory here) and whose event id may be given (p_event: NULL for one made here).
CREATE OR REPLACE FUNCTION mep_audit_h(p_event text, p_tenant text, p_type text, p_nh text, p_mh text,
                                       p_name text, p_memory text, p_token bigint, p_now bigint)
RETURNS integer LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash,
                           redacted_memory_hash, fencing_token, created_at)
  VALUES (coalesce(p_event, mep_uuid7(p_now)), p_tenant, p_type, coalesce(p_nh, mep_hash(p_tenant, p_name)),
          coalesce(p_mh, mep_hash(p_tenant, p_memory)), p_token, p_now);
  RETURN 1;
END
$$;

-- One audit row, its name and memory hashed here; returns 1.
CREATE OR REPLACE FUNCTION mep_audit(p_tenant text, p_type text, p_name text, p_memory text,
                                     p_token bigint, p_now bigint) RETURNS integer LANGUAGE sql AS $$
  SELECT mep_audit_h(NULL, p_tenant, p_type, NULL, NULL, p_name, p_memory, p_token, p_now)
$$;

-- Stores a call's outcome under its Idempotency-Key (looked up and not found at the call's
-- start, or found expired) and returns the answer. A key that a concurrent call committed
-- meanwhile rolls this call back as a serialization failure: run again, it replays.
CREATE OR REPLACE FUNCTION mep_idem_put(p_tenant text, p_key text, p_fp text, p_now bigint,
                                        p_status integer, p_result jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_stored text;
BEGIN
  INSERT INTO idempotency AS i (tenant_id, idem_key, fingerprint, status, body, created_at, expires_at)
  VALUES (p_tenant, p_key, p_fp, p_status, p_result::text, p_now, p_now + 86400000)
  ON CONFLICT (tenant_id, idem_key) DO UPDATE
    SET fingerprint = excluded.fingerprint, status = excluded.status, body = excluded.body,
        created_at = excluded.created_at, expires_at = excluded.expires_at
    WHERE i.expires_at <= p_now
  RETURNING i.idem_key INTO v_stored;
  IF v_stored IS NULL THEN
    RAISE EXCEPTION 'a concurrent call stored an outcome under this Idempotency-Key' USING ERRCODE = '40001';
  END IF;
  RETURN jsonb_build_object('status', p_status, 'replayed', false, 'result', p_result);
END
$$;

-- Release: 204 also when the grant already ended (idempotent); an expired row goes now.
CREATE OR REPLACE FUNCTION mep_release(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_request_id text) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_tenant text;
  v_name text;
  v_nh text;
  v_mh text;
  v_problem jsonb;
  v_n integer;
BEGIN
  DELETE FROM leases
   WHERE memory_id = p_memory AND fencing_token = p_token AND tenant_id = p_tenant
     AND canonical_name = p_name AND owner_client_id = p_owner
     AND (expires_at > v_now OR mep_step_held(expires_at, ttl_seconds, v_now))
  RETURNING canonical_name, name_hash, memory_hash INTO v_name, v_nh, v_mh;
  IF v_name IS NOT NULL THEN
    v_n := mep_audit_h(NULL, p_tenant, 'LEASE_RELEASED', v_nh, v_mh, v_name, p_memory, p_token, v_now);
    RETURN '{"outcome": "released"}'::jsonb;
  END IF;
  v_problem := mep_classify(p_tenant, p_memory, p_token, v_now, 'lease-not-found', p_request_id);
  IF v_problem IS NULL THEN
    RETURN mep_problem('lease-not-found', 'no lease of this owner under this name', p_request_id);
  END IF;
  IF v_problem->>'code' <> 'lease-expired' THEN
    RETURN v_problem;
  END IF;
  DELETE FROM leases WHERE memory_id = p_memory AND fencing_token = p_token AND expires_at <= v_now
  RETURNING tenant_id, canonical_name, name_hash, memory_hash INTO v_tenant, v_name, v_nh, v_mh;
  IF v_name IS NOT NULL THEN
    v_n := mep_audit_h(NULL, v_tenant, 'LEASE_EXPIRED', v_nh, v_mh, v_name, p_memory, p_token, v_now);
  END IF;
  RETURN '{"outcome": "released"}'::jsonb;
END
$$;

-- Removes expired leases (auditing each) and idempotency records, a bounded number per
-- call; rows another transaction holds are left for the next call (several servers sweep).
-- Leases go by the lesser of the clock and p_bound (see mep_claim), and not while a step
-- holds them back.
CREATE OR REPLACE FUNCTION mep_sweep(p_bound bigint) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_take bigint := least(v_now, coalesce(p_bound, v_now));
  v_expired jsonb;
  v_n integer := 0;
  v_c bigint;
BEGIN
  WITH d AS (
    DELETE FROM leases WHERE lease_id IN
      (SELECT lease_id FROM leases WHERE expires_at <= v_take LIMIT 1000 FOR UPDATE SKIP LOCKED)
      AND expires_at <= v_take AND NOT mep_step_held(expires_at, ttl_seconds, v_now)
    RETURNING tenant_id, canonical_name, memory_id, fencing_token, name_hash, memory_hash)
  SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object('tenant', tenant_id, 'n', canonical_name,
                     'm', memory_id, 't', fencing_token, 'nh', name_hash, 'mh', memory_hash)))
    INTO v_expired FROM d;
  IF v_expired IS NOT NULL THEN
    v_n := mep_audit_many(v_expired, 'LEASE_EXPIRED', NULL, v_now);
  END IF;
  WITH d AS (
    DELETE FROM idempotency WHERE (tenant_id, idem_key) IN
      (SELECT tenant_id, idem_key FROM idempotency WHERE expires_at <= v_now LIMIT 5000 FOR UPDATE SKIP LOCKED)
      AND expires_at <= v_now
    RETURNING 1)
  SELECT count(*) INTO v_c FROM d;
  RETURN v_n + v_c;
END
$$;
CREATE OR REPLACE FUNCTION mep_sweep() RETURNS bigint LANGUAGE sql AS $$
  SELECT mep_sweep(NULL::bigint)
$$;

-- SPEC §6.1: the atomic claim. p_pre, when given, is a problem found before the call
-- (invalid name or TTL) that is only recorded under the Idempotency-Key and answered.
-- p_ticket: the claim's place in the queue of waiting claims (mep_waiters), NULL for a
-- claim that does not wait; a grant takes the ticket out of the queue. p_bound: the latest
-- time the database clock can read by the calling server's monotonic clock, NULL when it
-- has none yet. p_event, p_name_hash, p_memory_hash: the audit row's event id and the
-- HMACs of the name and the memory under the tenant's salt, NULL to make them here.
CREATE OR REPLACE FUNCTION mep_claim(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint, p_bound bigint,
    p_event text, p_name_hash text, p_memory_hash text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_nh text := coalesce(p_name_hash, mep_hash(p_tenant, p_name));
  v_mh text := coalesce(p_memory_hash, mep_hash(p_tenant, p_memory));
  v_take bigint;
  v_fp text;
  v_status integer;
  v_body text;
  v_waiting bigint;
  v_waiting_alive bigint;
  v_mem_tenant text;
  v_counter bigint;
  v_expired jsonb;
  v_all_expired jsonb;
  v_takeable bigint;
  v_reclaim_id text;
  v_name_held bigint;
  v_name_expires bigint;
  v_skel_held bigint;
  v_skel_expires bigint;
  v_held_id text;
  v_held_expires bigint;
  v_inserted text;
  v_granted_at bigint;
  v_token bigint;
  v_lease_id text;
  v_attempt integer := 0;
  v_pass integer;
  v_result jsonb;
  v_stored text;
  v_n integer;
BEGIN
  -- The outcome stored under the key, if any: replayed (or 422 for another request).
  SELECT fingerprint, status, body INTO v_fp, v_status, v_body FROM idempotency
   WHERE tenant_id = p_tenant AND idem_key = p_key AND expires_at > v_now;
  IF v_fp IS NOT NULL THEN
    IF v_fp <> p_fp THEN
      RETURN jsonb_build_object('status', 422, 'replayed', false, 'result',
               mep_problem('idempotency-key-reused', 'this Idempotency-Key was used with a different request',
                           p_request_id));
    END IF;
    RETURN jsonb_build_object('status', v_status, 'replayed', true, 'result', v_body::jsonb);
  END IF;
  IF p_pre IS NOT NULL THEN
    RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 400, p_pre);
  END IF;
  -- The memory exists, is the tenant's, and is locked against concurrent claims.
  SELECT tenant_id, fence_counter INTO v_mem_tenant, v_counter
    FROM memories WHERE memory_id = p_memory FOR UPDATE;
  IF v_mem_tenant IS DISTINCT FROM p_tenant THEN
    RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 404,
                        mep_problem('memory-not-found', 'no such memory for this tenant', p_request_id));
  END IF;
  LOOP
    -- The time is read after the memory lock (and again after a lost race), so it is later
    -- than the commit of every grant and release this claim observes.
    v_now := mep_now_ms();
    v_take := least(v_now, coalesce(p_bound, v_now));
    v_pass := 0;
    LOOP
      -- The rows that share the name, the skeleton or the memory (at most three): how many
      -- have expired and may be taken over; the caller's own live lease under this name (a
      -- re-claim); anyone else's lease on the name, on the skeleton, on the memory.
      SELECT count(*) FILTER (WHERE expires_at <= v_take AND NOT mep_step_held(expires_at, ttl_seconds, v_now)),
             min(lease_id) FILTER (WHERE r),
             count(*) FILTER (WHERE canonical_name = p_name AND NOT r),
             min(expires_at) FILTER (WHERE canonical_name = p_name AND NOT r),
             count(*) FILTER (WHERE skeleton = p_skeleton AND canonical_name <> p_name AND NOT r),
             min(expires_at) FILTER (WHERE skeleton = p_skeleton AND canonical_name <> p_name AND NOT r),
             min(lease_id) FILTER (WHERE memory_id = p_memory AND NOT r),
             min(expires_at) FILTER (WHERE memory_id = p_memory AND NOT r)
        INTO v_takeable, v_reclaim_id, v_name_held, v_name_expires, v_skel_held, v_skel_expires,
             v_held_id, v_held_expires
        FROM (SELECT l.*, (l.canonical_name = p_name AND l.tenant_id = p_tenant AND l.owner_client_id = p_owner
                           AND l.memory_id = p_memory) AS r
                FROM leases l
               WHERE l.canonical_name = p_name OR l.skeleton = p_skeleton OR l.memory_id = p_memory) AS c;
      EXIT WHEN v_takeable = 0;
      -- Takeover: expired leases conflicting on name, skeleton or memory go (SPEC §12.2), by
      -- the database clock and by the bound the server's monotonic clock sets on it, and not
      -- while a step of the clock holds them back.
      v_pass := v_pass + 1;
      IF v_pass > 3 THEN
        RAISE EXCEPTION 'claim kept finding expired leases to take over' USING ERRCODE = '40001';
      END IF;
      WITH d AS (
        DELETE FROM leases
         WHERE (canonical_name = p_name OR skeleton = p_skeleton OR memory_id = p_memory)
           AND expires_at <= v_take AND NOT mep_step_held(expires_at, ttl_seconds, v_now)
        RETURNING tenant_id, canonical_name, memory_id, fencing_token, name_hash, memory_hash)
      SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object('tenant', tenant_id, 'n', canonical_name,
                         'm', memory_id, 't', fencing_token, 'nh', name_hash, 'mh', memory_hash)))
        INTO v_expired FROM d;
      IF v_expired IS NOT NULL THEN
        v_n := mep_audit_many(v_expired, 'LEASE_EXPIRED', NULL, v_now);
        v_all_expired := coalesce(v_all_expired, '[]'::jsonb) || v_expired;
      END IF;
    END LOOP;
    IF v_name_held > 0 OR v_skel_held > 0 THEN
      v_n := mep_audit_h(p_event, p_tenant, 'NAME_CONFLICT', v_nh, v_mh, p_name, p_memory, NULL, v_now);
      IF v_name_held > 0 THEN
        RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 423,
                 mep_problem('name-held', format('the name "%s" is held by another owner', p_name), p_request_id)
                 || jsonb_build_object('retry_after', mep_retry_after(v_name_expires, v_now))
                 || mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now));
      END IF;
      RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 423,
               mep_problem('name-confusable',
                           format('the name "%s" is confusable with a name that is held', p_name), p_request_id)
               || jsonb_build_object('retry_after', mep_retry_after(v_skel_expires, v_now))
               || mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now));
    END IF;
    -- A live lease on the memory under another name or owner.
    IF v_held_id IS NOT NULL THEN
      RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 423,
               mep_problem('memory-attached', 'this memory is attached to another lease', p_request_id)
               || jsonb_build_object('retry_after', mep_retry_after(v_held_expires, v_now))
               || mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now));
    END IF;
    -- Claims waiting for the skeleton or the memory come first: any of them for a claim
    -- that does not wait (p_ticket NULL), the earlier ones for a waiting claim. A re-claim
    -- of the caller's own live lease holds no one up and is not held up.
    -- (Inline rather than a function of its own: every claim that starts a lease runs it.)
    IF v_reclaim_id IS NULL THEN
      SELECT count(*), min(alive_until) INTO v_waiting, v_waiting_alive FROM mep_waiters
       WHERE (skeleton = p_skeleton OR memory_id = p_memory) AND (p_ticket IS NULL OR waiter_id < p_ticket)
         AND NOT abandoned AND alive_until > v_now;
      IF v_waiting > 0 THEN
        RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 423,
                 mep_problem('name-held', 'the name or the memory is free, but earlier claims are waiting for it',
                             p_request_id)
                 || jsonb_build_object('retry_after', mep_retry_after(v_waiting_alive, v_now),
                                       'ext', jsonb_build_object('waiters', v_waiting)));
      END IF;
    END IF;
    -- Grant.
    v_token := v_counter + 1;
    IF v_reclaim_id IS NOT NULL THEN
      -- A re-claim: the caller's own row, under the memory's lock, takes the new grant. It
      -- waits for no other claim, so its stamp needs no second look (below).
      v_lease_id := v_reclaim_id;
      UPDATE leases SET display_name = p_display, fencing_token = v_token, ttl_seconds = p_ttl,
                        acquired_at = c.t, expires_at = c.t + p_ttl * 1000, name_hash = v_nh, memory_hash = v_mh
        FROM (SELECT mep_now_ms() AS t) AS c
       WHERE lease_id = v_lease_id
      RETURNING lease_id, acquired_at INTO v_inserted, v_granted_at;
      EXIT WHEN v_inserted IS NOT NULL;
      -- Released meanwhile: look again.
    ELSE
      v_lease_id := p_lease_id;
      -- The grant is stamped when its row goes in. An insert may wait at the unique index
      -- for a concurrent claim of the name, which may commit and be released meanwhile; a
      -- stamp taken before that wait would date the grant before that release. So the
      -- clock is read again after the insert and, if it moved, the row is restamped. Either
      -- stamp is earlier than the commit, so the expiry never outlasts grant + TTL.
      INSERT INTO leases(lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id,
                         fencing_token, owner_client_id, ttl_seconds, expires_at, acquired_at, name_hash, memory_hash)
      SELECT v_lease_id, p_tenant, p_name, p_display, p_skeleton, p_memory, v_token, p_owner, p_ttl,
             c.t + p_ttl * 1000, c.t, v_nh, v_mh
        FROM (SELECT mep_now_ms() AS t) AS c
      ON CONFLICT DO NOTHING
      RETURNING lease_id, acquired_at INTO v_inserted, v_granted_at;
      IF v_inserted IS NOT NULL THEN
        v_now := mep_now_ms();
        IF v_now <> v_granted_at THEN
          v_granted_at := v_now;
          UPDATE leases SET acquired_at = v_granted_at, expires_at = v_granted_at + p_ttl * 1000
           WHERE lease_id = v_lease_id;
        END IF;
        EXIT;
      END IF;
      -- A concurrent claim took the name or skeleton and committed: look again.
    END IF;
    v_attempt := v_attempt + 1;
    IF v_attempt >= 3 THEN
      RAISE EXCEPTION 'claim lost a race for its name' USING ERRCODE = '40001';
    END IF;
  END LOOP;
  v_now := v_granted_at;
  IF p_ticket IS NOT NULL THEN
    DELETE FROM mep_waiters WHERE waiter_id = p_ticket;
  END IF;
  IF v_all_expired IS NOT NULL THEN
    v_n := mep_audit_many(v_all_expired, 'LEASE_TAKEOVER', p_tenant, v_now);
  END IF;
  v_result := jsonb_build_object('lease_id', v_lease_id, 'canonical_name', p_name,
                'display_name', p_display, 'memory_instance_id', p_memory, 'fencing_token', v_token,
                'expires_at', v_granted_at + p_ttl * 1000, 'ttl_seconds', p_ttl, 'server_time', v_granted_at,
                'outcome', CASE WHEN v_reclaim_id IS NOT NULL THEN 'reclaimed' ELSE 'granted' END);
  -- The rest of the grant in one statement (each statement has a cost of its own): the
  -- memory's counter, the name's history, the audit row, and the outcome under the key
  -- (mep_idem_put's rule: a key taken meanwhile rolls the call back, to be replayed).
  -- (The history row is rewritten on every grant: a WHERE that skipped unchanged rows, as
  -- the SQLite backend does, cost more, since ON CONFLICT still locks the row it skips.)
  WITH m AS (UPDATE memories SET fence_counter = v_token WHERE memory_id = p_memory),
       n AS (INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version,
                                     icu_version, first_claimed_at, last_claimed_at)
             VALUES (p_name, p_display, p_skeleton, p_tenant, p_unicode, p_icu, v_granted_at, v_granted_at)
             ON CONFLICT (canonical_name) DO UPDATE
               SET display_name = excluded.display_name, skeleton = excluded.skeleton,
                   tenant_id = excluded.tenant_id, unicode_version = excluded.unicode_version,
                   icu_version = excluded.icu_version, last_claimed_at = excluded.last_claimed_at),
       a AS (INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash,
                                      redacted_memory_hash, fencing_token, created_at)
             VALUES (coalesce(p_event, mep_uuid7(v_now)), p_tenant, 'LEASE_ACQUIRED', v_nh, v_mh, v_token, v_now))
  INSERT INTO idempotency AS i (tenant_id, idem_key, fingerprint, status, body, created_at, expires_at)
  VALUES (p_tenant, p_key, p_fp, 201, v_result::text, v_now, v_now + 86400000)
  ON CONFLICT (tenant_id, idem_key) DO UPDATE
    SET fingerprint = excluded.fingerprint, status = excluded.status, body = excluded.body,
        created_at = excluded.created_at, expires_at = excluded.expires_at
    WHERE i.expires_at <= v_now
  RETURNING i.idem_key INTO v_stored;
  IF v_stored IS NULL THEN
    RAISE EXCEPTION 'a concurrent call stored an outcome under this Idempotency-Key' USING ERRCODE = '40001';
  END IF;
  RETURN jsonb_build_object('status', 201, 'replayed', false, 'result', v_result);
END
$$;

-- A waiting claim's attempt (Prefer: wait): mep_claim, except that a refusal because the
-- name or the memory is held (423) is not kept under the Idempotency-Key, so the next
-- attempt under the same key runs again instead of replaying it. Every other outcome is
-- kept. One call, one transaction.
CREATE OR REPLACE FUNCTION mep_claim_attempt(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint, p_bound bigint,
    p_event text, p_name_hash text, p_memory_hash text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v jsonb;
BEGIN
  v := mep_claim(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                 p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket, p_bound, p_event, p_name_hash,
                 p_memory_hash);
  IF (v->>'status')::integer = 423 AND NOT (v->>'replayed')::boolean THEN
    DELETE FROM idempotency WHERE tenant_id = p_tenant AND idem_key = p_key AND status = 423;
  END IF;
  RETURN v;
END
$$;

-- The claim functions of v1, v4, v5 and v6, kept for servers of an earlier version that
-- still run during a rolling upgrade: they set no bound (before v6), wait in no queue
-- (before v5), and leave the hashes and the event id to the database.
CREATE OR REPLACE FUNCTION mep_claim(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint, p_bound bigint) RETURNS jsonb
LANGUAGE sql AS $$
  SELECT mep_claim(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                   p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket, p_bound, NULL, NULL, NULL)
$$;
CREATE OR REPLACE FUNCTION mep_claim_attempt(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint, p_bound bigint) RETURNS jsonb
LANGUAGE sql AS $$
  SELECT mep_claim_attempt(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                           p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket, p_bound, NULL, NULL, NULL)
$$;
CREATE OR REPLACE FUNCTION mep_claim(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint) RETURNS jsonb
LANGUAGE sql AS $$
  SELECT mep_claim(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                   p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket, NULL::bigint, NULL, NULL, NULL)
$$;
CREATE OR REPLACE FUNCTION mep_claim_attempt(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint) RETURNS jsonb
LANGUAGE sql AS $$
  SELECT mep_claim_attempt(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                           p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket, NULL::bigint, NULL, NULL, NULL)
$$;
)sql";

// Version 8: renewals (and fence verifications) carry the clock's bound, as claims and
// sweeps have since v6. A forward
// step of the database clock made every lease whose expiry it jumped over look expired to a
// renewal until a server found the step and recorded it (up to a second later): the holder
// was told 410 lease-expired and gave its lease up, though no claim could have taken it (a
// claim's bound still held it). Now a renewal decides liveness at least(now, bound), as a
// claim does, and the new expiry is still max(old, now + ttl). The v1 signatures stay, as
// wrappers without a bound, for servers of an earlier version during a rolling upgrade.
const std::string_view k_pg_schema_v8 = R"sql(
-- Renews one lease: the expiry becomes max(old, now + ttl), never shorter. p_take: the time
-- that decides whether the lease is still live (now, or the bound the server's monotonic
-- clock sets on it when that is earlier).
CREATE OR REPLACE FUNCTION mep_renew_one(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_ttl bigint, p_now bigint, p_take bigint, p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_exp bigint;
  v_problem jsonb;
BEGIN
  IF p_ttl < 5 OR p_ttl > 300 THEN
    RETURN mep_problem('invalid-ttl', format('ttl_seconds must be between 5 and 300 (got %s)', p_ttl),
                       p_request_id);
  END IF;
  UPDATE leases SET expires_at = greatest(expires_at, p_now + p_ttl * 1000), ttl_seconds = p_ttl
   WHERE memory_id = p_memory AND fencing_token = p_token AND tenant_id = p_tenant
     AND canonical_name = p_name AND owner_client_id = p_owner
     AND (expires_at > p_take OR mep_step_held(expires_at, ttl_seconds, p_now))
  RETURNING expires_at INTO v_exp;
  IF v_exp IS NOT NULL THEN
    RETURN jsonb_build_object('expires_at', v_exp, 'ttl_seconds', p_ttl, 'server_time', p_now);
  END IF;
  v_problem := mep_classify(p_tenant, p_memory, p_token, p_now, 'lease-not-found', p_request_id);
  IF v_problem IS NOT NULL THEN
    RETURN v_problem;
  END IF;
  RETURN mep_problem('lease-not-found', 'no lease of this owner under this name', p_request_id);
END
$$;
-- Called by v1's mep_renew and mep_renew_batch only, which are wrappers now (below).
DROP FUNCTION IF EXISTS mep_renew_one(text, text, text, bigint, text, bigint, bigint, text);

-- p_bound: the latest time the database clock can read by the calling server's monotonic
-- clock, NULL when it has none yet.
CREATE OR REPLACE FUNCTION mep_renew(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_ttl bigint, p_request_id text, p_bound bigint) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
BEGIN
  RETURN mep_renew_one(p_tenant, p_name, p_memory, p_token, p_owner, p_ttl, v_now,
                       least(v_now, coalesce(p_bound, v_now)), p_request_id);
END
$$;

-- Renews many leases in one transaction; the results are in the order of the arrays.
CREATE OR REPLACE FUNCTION mep_renew_batch(p_tenant text, p_names text[], p_memories text[],
    p_tokens bigint[], p_owners text[], p_ttls bigint[], p_request_id text, p_bound bigint) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_take bigint := least(v_now, coalesce(p_bound, v_now));
  v_out jsonb;
BEGIN
  SELECT coalesce(jsonb_agg(mep_renew_one(p_tenant, p_names[i], p_memories[i], p_tokens[i],
                                          p_owners[i], p_ttls[i], v_now, v_take, p_request_id) ORDER BY i),
                  '[]'::jsonb)
    INTO v_out
    FROM generate_series(1, coalesce(array_length(p_names, 1), 0)) AS i;
  RETURN v_out;
END
$$;

-- The v1 signatures, kept for servers of an earlier version during a rolling upgrade: no
-- bound, as before.
CREATE OR REPLACE FUNCTION mep_renew(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_ttl bigint, p_request_id text) RETURNS jsonb LANGUAGE sql AS $$
  SELECT mep_renew(p_tenant, p_name, p_memory, p_token, p_owner, p_ttl, p_request_id, NULL::bigint)
$$;
CREATE OR REPLACE FUNCTION mep_renew_batch(p_tenant text, p_names text[], p_memories text[],
    p_tokens bigint[], p_owners text[], p_ttls bigint[], p_request_id text) RETURNS jsonb LANGUAGE sql AS $$
  SELECT mep_renew_batch(p_tenant, p_names, p_memories, p_tokens, p_owners, p_ttls, p_request_id, NULL::bigint)
$$;

-- Whether a token's lease is live (POST /v1/fence/verify), decided at least(now, bound) as
-- a renewal is: in the second after a forward step that no server has found yet, a live
-- lease is not called expired (its holder's writes through mep store --strict go on).
CREATE OR REPLACE FUNCTION mep_verify(p_tenant text, p_memory text, p_token bigint, p_request_id text,
    p_bound bigint) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_problem jsonb;
  v_name text;
  v_token bigint;
  v_expires bigint;
BEGIN
  v_problem := mep_classify(p_tenant, p_memory, p_token, least(v_now, coalesce(p_bound, v_now)),
                            'memory-not-found', p_request_id);
  IF v_problem IS NOT NULL THEN
    RETURN v_problem;
  END IF;
  SELECT canonical_name, fencing_token, expires_at INTO v_name, v_token, v_expires
    FROM leases WHERE memory_id = p_memory;
  RETURN jsonb_build_object('memory_instance_id', p_memory, 'fencing_token', v_token,
                            'canonical_name', v_name, 'expires_at', v_expires, 'server_time', v_now);
END
$$;
-- Its v1 signature, for servers of an earlier version (no bound).
CREATE OR REPLACE FUNCTION mep_verify(p_tenant text, p_memory text, p_token bigint, p_request_id text)
RETURNS jsonb LANGUAGE sql AS $$
  SELECT mep_verify(p_tenant, p_memory, p_token, p_request_id, NULL::bigint)
$$;
)sql";

// Version 9: a claim costs the database a fifth less. Measured with callgrind on a
// single-user backend (bench/pg_callgrind.sh, instructions per re-claim): 849k for v8's
// function, 648k for v9's. (By a first harness: 943k, then 846k with the first two changes
// below, 756k with all three.)
// * The memory's row lock and the Idempotency-Key lookup are one statement, not two.
// * The rows sharing the name, the skeleton or the memory are first looked up by the unique
//   indexes alone: the caller's own live lease under the name (a re-claim), or no row at
//   all (a fresh claim), needs no aggregate over them; anything else (a takeover, a
//   refusal, a step-held row) takes v8's path. An aggregate of eight filtered columns cost
//   more to set up than the lookups it replaces.
// * The answer is built as JSON text, and stored and returned as such (jsonb_build_object
//   and jsonb_out, twice, were a tenth of the call). mep_claim_t returns text; a waiting
//   claim's attempt passes p_keep_refusal false instead of storing a refusal and deleting it.
// The v8 functions stay, as wrappers, for servers of an earlier version during a rolling
// upgrade.
const std::string_view k_pg_schema_v9 = R"sql(
-- An answer stored under the Idempotency-Key (mep_idem_put), or, when p_keep is false, only
-- returned: what a waiting claim's attempt does with a refusal (423), so that the next
-- attempt under the same key runs again instead of replaying it.
CREATE OR REPLACE FUNCTION mep_idem_answer(p_keep boolean, p_tenant text, p_key text, p_fp text, p_now bigint,
                                           p_status integer, p_result jsonb) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
  IF p_keep THEN
    RETURN mep_idem_put(p_tenant, p_key, p_fp, p_now, p_status, p_result)::text;
  END IF;
  RETURN jsonb_build_object('status', p_status, 'replayed', false, 'result', p_result)::text;
END
$$;

-- SPEC §6.1: the atomic claim, as v7's mep_claim (its parameters are described there), with
-- the answer {status, replayed, result} as JSON text. p_keep_refusal: false for a waiting
-- claim's attempt (Prefer: wait), whose refusals because the name or the memory is held
-- (423) are not kept under the Idempotency-Key; every other outcome is kept.
CREATE OR REPLACE FUNCTION mep_claim_t(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint, p_bound bigint,
    p_event text, p_name_hash text, p_memory_hash text, p_keep_refusal boolean) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_nh text := coalesce(p_name_hash, mep_hash(p_tenant, p_name));
  v_mh text := coalesce(p_memory_hash, mep_hash(p_tenant, p_memory));
  v_take bigint;
  v_fp text;
  v_status integer;
  v_body text;
  v_waiting bigint;
  v_waiting_alive bigint;
  v_mem_tenant text;
  v_counter bigint;
  v_expired jsonb;
  v_all_expired jsonb;
  v_takeable bigint;
  v_reclaim_id text;
  v_name_held bigint;
  v_name_expires bigint;
  v_skel_held bigint;
  v_skel_expires bigint;
  v_held_id text;
  v_held_expires bigint;
  v_inserted text;
  v_granted_at bigint;
  v_token bigint;
  v_lease_id text;
  v_attempt integer := 0;
  v_pass integer;
  v_result text;
  v_t bigint;
  v_stored text;
  v_n integer;
  v_row_id text;
  v_own boolean;
  v_clear boolean;
BEGIN
  -- The memory, locked against concurrent claims, and the outcome stored under the key, if
  -- any, in one statement (each statement has a cost of its own). A call with a problem
  -- found before it (p_pre), or for a memory that does not exist, looks up the key alone.
  IF p_pre IS NULL THEN
    SELECT m.tenant_id, m.fence_counter, i.fingerprint, i.status, i.body
      INTO v_mem_tenant, v_counter, v_fp, v_status, v_body
      FROM memories m LEFT JOIN idempotency i
        ON i.tenant_id = p_tenant AND i.idem_key = p_key AND i.expires_at > v_now
     WHERE m.memory_id = p_memory FOR UPDATE OF m;
  END IF;
  IF v_mem_tenant IS NULL THEN
    SELECT fingerprint, status, body INTO v_fp, v_status, v_body FROM idempotency
     WHERE tenant_id = p_tenant AND idem_key = p_key AND expires_at > v_now;
  END IF;
  -- Replayed (or 422 for another request).
  IF v_fp IS NOT NULL THEN
    IF v_fp <> p_fp THEN
      RETURN jsonb_build_object('status', 422, 'replayed', false, 'result',
               mep_problem('idempotency-key-reused', 'this Idempotency-Key was used with a different request',
                           p_request_id))::text;
    END IF;
    RETURN '{"status": ' || v_status || ', "replayed": true, "result": ' || v_body || '}';
  END IF;
  IF p_pre IS NOT NULL THEN
    RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 400, p_pre)::text;
  END IF;
  -- The memory exists and is the tenant's.
  IF v_mem_tenant IS DISTINCT FROM p_tenant THEN
    RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 404,
                        mep_problem('memory-not-found', 'no such memory for this tenant', p_request_id))::text;
  END IF;
  LOOP
    -- The time is read after the memory lock (and again after a lost race), so it is later
    -- than the commit of every grant and release this claim observes.
    v_now := mep_now_ms();
    v_take := least(v_now, coalesce(p_bound, v_now));
    v_pass := 0;
    -- The common cases first, by the unique indexes alone: the caller's own live lease
    -- under this name (a re-claim: no other row can share its name, skeleton or memory), or
    -- no lease on the name, the skeleton or the memory at all. Anything else, below.
    SELECT lease_id, (tenant_id = p_tenant AND owner_client_id = p_owner AND memory_id = p_memory
                      AND skeleton = p_skeleton AND expires_at > v_take)
      INTO v_row_id, v_own FROM leases WHERE canonical_name = p_name;
    IF v_row_id IS NULL THEN
      SELECT lease_id INTO v_row_id FROM leases WHERE skeleton = p_skeleton OR memory_id = p_memory LIMIT 1;
      v_clear := v_row_id IS NULL;
    ELSE
      v_clear := v_own;
    END IF;
    IF v_clear THEN
      v_reclaim_id := v_row_id; -- NULL when no row shares anything
      v_name_held := 0;
      v_skel_held := 0;
      v_held_id := NULL;
    END IF;
    LOOP
      EXIT WHEN v_clear;
      -- The rows that share the name, the skeleton or the memory (at most three): how many
      -- have expired and may be taken over; the caller's own live lease under this name (a
      -- re-claim); anyone else's lease on the name, on the skeleton, on the memory.
      SELECT count(*) FILTER (WHERE expires_at <= v_take AND NOT mep_step_held(expires_at, ttl_seconds, v_now)),
             min(lease_id) FILTER (WHERE r),
             count(*) FILTER (WHERE canonical_name = p_name AND NOT r),
             min(expires_at) FILTER (WHERE canonical_name = p_name AND NOT r),
             count(*) FILTER (WHERE skeleton = p_skeleton AND canonical_name <> p_name AND NOT r),
             min(expires_at) FILTER (WHERE skeleton = p_skeleton AND canonical_name <> p_name AND NOT r),
             min(lease_id) FILTER (WHERE memory_id = p_memory AND NOT r),
             min(expires_at) FILTER (WHERE memory_id = p_memory AND NOT r)
        INTO v_takeable, v_reclaim_id, v_name_held, v_name_expires, v_skel_held, v_skel_expires,
             v_held_id, v_held_expires
        FROM (SELECT l.*, (l.canonical_name = p_name AND l.tenant_id = p_tenant AND l.owner_client_id = p_owner
                           AND l.memory_id = p_memory) AS r
                FROM leases l
               WHERE l.canonical_name = p_name OR l.skeleton = p_skeleton OR l.memory_id = p_memory) AS c;
      EXIT WHEN v_takeable = 0;
      -- Takeover: expired leases conflicting on name, skeleton or memory go (SPEC §12.2), by
      -- the database clock and by the bound the server's monotonic clock sets on it, and not
      -- while a step of the clock holds them back.
      v_pass := v_pass + 1;
      IF v_pass > 3 THEN
        RAISE EXCEPTION 'claim kept finding expired leases to take over' USING ERRCODE = '40001';
      END IF;
      WITH d AS (
        DELETE FROM leases
         WHERE (canonical_name = p_name OR skeleton = p_skeleton OR memory_id = p_memory)
           AND expires_at <= v_take AND NOT mep_step_held(expires_at, ttl_seconds, v_now)
        RETURNING tenant_id, canonical_name, memory_id, fencing_token, name_hash, memory_hash)
      SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object('tenant', tenant_id, 'n', canonical_name,
                         'm', memory_id, 't', fencing_token, 'nh', name_hash, 'mh', memory_hash)))
        INTO v_expired FROM d;
      IF v_expired IS NOT NULL THEN
        v_n := mep_audit_many(v_expired, 'LEASE_EXPIRED', NULL, v_now);
        v_all_expired := coalesce(v_all_expired, '[]'::jsonb) || v_expired;
      END IF;
    END LOOP;
    IF v_name_held > 0 OR v_skel_held > 0 THEN
      v_n := mep_audit_h(p_event, p_tenant, 'NAME_CONFLICT', v_nh, v_mh, p_name, p_memory, NULL, v_now);
      IF v_name_held > 0 THEN
        RETURN mep_idem_answer(p_keep_refusal, p_tenant, p_key, p_fp, v_now, 423,
                 mep_problem('name-held', format('the name "%s" is held by another owner', p_name), p_request_id)
                 || jsonb_build_object('retry_after', mep_retry_after(v_name_expires, v_now))
                 || mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now));
      END IF;
      RETURN mep_idem_answer(p_keep_refusal, p_tenant, p_key, p_fp, v_now, 423,
               mep_problem('name-confusable',
                           format('the name "%s" is confusable with a name that is held', p_name), p_request_id)
               || jsonb_build_object('retry_after', mep_retry_after(v_skel_expires, v_now))
               || mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now));
    END IF;
    -- A live lease on the memory under another name or owner.
    IF v_held_id IS NOT NULL THEN
      RETURN mep_idem_answer(p_keep_refusal, p_tenant, p_key, p_fp, v_now, 423,
               mep_problem('memory-attached', 'this memory is attached to another lease', p_request_id)
               || jsonb_build_object('retry_after', mep_retry_after(v_held_expires, v_now))
               || mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now));
    END IF;
    -- Claims waiting for the skeleton or the memory come first: any of them for a claim
    -- that does not wait (p_ticket NULL), the earlier ones for a waiting claim. A re-claim
    -- of the caller's own live lease holds no one up and is not held up.
    -- (Inline rather than a function of its own: every claim that starts a lease runs it.)
    IF v_reclaim_id IS NULL THEN
      SELECT count(*), min(alive_until) INTO v_waiting, v_waiting_alive FROM mep_waiters
       WHERE (skeleton = p_skeleton OR memory_id = p_memory) AND (p_ticket IS NULL OR waiter_id < p_ticket)
         AND NOT abandoned AND alive_until > v_now;
      IF v_waiting > 0 THEN
        RETURN mep_idem_answer(p_keep_refusal, p_tenant, p_key, p_fp, v_now, 423,
                 mep_problem('name-held', 'the name or the memory is free, but earlier claims are waiting for it',
                             p_request_id)
                 || jsonb_build_object('retry_after', mep_retry_after(v_waiting_alive, v_now),
                                       'ext', jsonb_build_object('waiters', v_waiting)));
      END IF;
    END IF;
    -- Grant.
    v_token := v_counter + 1;
    IF v_reclaim_id IS NOT NULL THEN
      -- A re-claim: the caller's own row, under the memory's lock, takes the new grant. It
      -- waits for no other claim, so its stamp needs no second look (below).
      v_lease_id := v_reclaim_id;
      v_t := mep_now_ms();
      UPDATE leases SET display_name = p_display, fencing_token = v_token, ttl_seconds = p_ttl,
                        acquired_at = v_t, expires_at = v_t + p_ttl * 1000, name_hash = v_nh, memory_hash = v_mh
       WHERE lease_id = v_lease_id
      RETURNING lease_id, acquired_at INTO v_inserted, v_granted_at;
      EXIT WHEN v_inserted IS NOT NULL;
      -- Released meanwhile: look again.
    ELSE
      v_lease_id := p_lease_id;
      v_t := mep_now_ms();
      -- The grant is stamped when its row goes in. An insert may wait at the unique index
      -- for a concurrent claim of the name, which may commit and be released meanwhile; a
      -- stamp taken before that wait would date the grant before that release. So the
      -- clock is read again after the insert and, if it moved, the row is restamped. Either
      -- stamp is earlier than the commit, so the expiry never outlasts grant + TTL.
      INSERT INTO leases(lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id,
                         fencing_token, owner_client_id, ttl_seconds, expires_at, acquired_at, name_hash, memory_hash)
      VALUES (v_lease_id, p_tenant, p_name, p_display, p_skeleton, p_memory, v_token, p_owner, p_ttl,
             v_t + p_ttl * 1000, v_t, v_nh, v_mh)
      ON CONFLICT DO NOTHING
      RETURNING lease_id, acquired_at INTO v_inserted, v_granted_at;
      IF v_inserted IS NOT NULL THEN
        v_now := mep_now_ms();
        IF v_now <> v_granted_at THEN
          v_granted_at := v_now;
          UPDATE leases SET acquired_at = v_granted_at, expires_at = v_granted_at + p_ttl * 1000
           WHERE lease_id = v_lease_id;
        END IF;
        EXIT;
      END IF;
      -- A concurrent claim took the name or skeleton and committed: look again.
    END IF;
    v_attempt := v_attempt + 1;
    IF v_attempt >= 3 THEN
      RAISE EXCEPTION 'claim lost a race for its name' USING ERRCODE = '40001';
    END IF;
  END LOOP;
  v_now := v_granted_at;
  IF p_ticket IS NOT NULL THEN
    DELETE FROM mep_waiters WHERE waiter_id = p_ticket;
  END IF;
  IF v_all_expired IS NOT NULL THEN
    v_n := mep_audit_many(v_all_expired, 'LEASE_TAKEOVER', p_tenant, v_now);
  END IF;
  v_result := '{"lease_id": ' || to_json(v_lease_id) || ', "canonical_name": ' || to_json(p_name)
    || ', "display_name": ' || to_json(p_display) || ', "memory_instance_id": ' || to_json(p_memory)
    || ', "fencing_token": ' || v_token || ', "expires_at": ' || (v_granted_at + p_ttl * 1000)
    || ', "ttl_seconds": ' || p_ttl || ', "server_time": ' || v_granted_at || ', "outcome": '
    || CASE WHEN v_reclaim_id IS NOT NULL THEN '"reclaimed"}' ELSE '"granted"}' END;
  -- The rest of the grant in one statement (each statement has a cost of its own): the
  -- memory's counter, the name's history, the audit row, and the outcome under the key
  -- (mep_idem_put's rule: a key taken meanwhile rolls the call back, to be replayed).
  -- (The history row is rewritten on every grant: a WHERE that skipped unchanged rows, as
  -- the SQLite backend does, cost more, since ON CONFLICT still locks the row it skips.)
  WITH m AS (UPDATE memories SET fence_counter = v_token WHERE memory_id = p_memory),
       n AS (INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version,
                                     icu_version, first_claimed_at, last_claimed_at)
             VALUES (p_name, p_display, p_skeleton, p_tenant, p_unicode, p_icu, v_granted_at, v_granted_at)
             ON CONFLICT (canonical_name) DO UPDATE
               SET display_name = excluded.display_name, skeleton = excluded.skeleton,
                   tenant_id = excluded.tenant_id, unicode_version = excluded.unicode_version,
                   icu_version = excluded.icu_version, last_claimed_at = excluded.last_claimed_at),
       a AS (INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash,
                                      redacted_memory_hash, fencing_token, created_at)
             VALUES (coalesce(p_event, mep_uuid7(v_now)), p_tenant, 'LEASE_ACQUIRED', v_nh, v_mh, v_token, v_now))
  INSERT INTO idempotency AS i (tenant_id, idem_key, fingerprint, status, body, created_at, expires_at)
  VALUES (p_tenant, p_key, p_fp, 201, v_result, v_now, v_now + 86400000)
  ON CONFLICT (tenant_id, idem_key) DO UPDATE
    SET fingerprint = excluded.fingerprint, status = excluded.status, body = excluded.body,
        created_at = excluded.created_at, expires_at = excluded.expires_at
    WHERE i.expires_at <= v_now
  RETURNING i.idem_key INTO v_stored;
  IF v_stored IS NULL THEN
    RAISE EXCEPTION 'a concurrent call stored an outcome under this Idempotency-Key' USING ERRCODE = '40001';
  END IF;
  RETURN '{"status": 201, "replayed": false, "result": ' || v_result || '}';
END
$$;

-- v8's signatures, for servers of an earlier version.
CREATE OR REPLACE FUNCTION mep_claim(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint, p_bound bigint,
    p_event text, p_name_hash text, p_memory_hash text) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
  RETURN mep_claim_t(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                     p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket, p_bound, p_event, p_name_hash,
                     p_memory_hash, true)::jsonb;
END
$$;
CREATE OR REPLACE FUNCTION mep_claim_attempt(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint, p_bound bigint,
    p_event text, p_name_hash text, p_memory_hash text) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
  RETURN mep_claim_t(p_tenant, p_key, p_fp, p_request_id, p_pre, p_name, p_display, p_skeleton, p_memory,
                     p_owner, p_ttl, p_lease_id, p_unicode, p_icu, p_ticket, p_bound, p_event, p_name_hash,
                     p_memory_hash, false)::jsonb;
END
$$;
)sql";

// Version 10: claims in batches. A server sends the claims queued while its earlier batches
// run in one call, one transaction and one commit; it keeps few of them in flight at once
// (PgStore::m_claim_lanes), so that a database on few cores is not shared by many backends
// each running one claim, which cost each claim more (see PgStore).
const std::string_view k_pg_schema_v10 = R"sql(
-- Several claims in one transaction: the i-th of each array is mep_claim_t's parameter of
-- the i-th claim (p_pre as jsonb text; p_unicode, p_icu and p_bound are the same for all).
-- Answers a JSON array of the claims' answers, in order. Every claim's memory is locked
-- first, in one order (by memory id), and the server sends the claims ordered by name: two
-- batches, or a batch and a single claim, then never wait for each other in a cycle on a
-- memory or a name. Any error rolls the whole batch back; the server then sends its claims
-- one by one.
CREATE OR REPLACE FUNCTION mep_claim_batch(p_tenant text[], p_key text[], p_fp text[], p_request_id text[],
    p_pre text[], p_name text[], p_display text[], p_skeleton text[], p_memory text[], p_owner text[],
    p_ttl bigint[], p_lease_id text[], p_unicode text, p_icu text, p_ticket bigint[], p_bound bigint,
    p_event text[], p_name_hash text[], p_memory_hash text[], p_keep_refusal boolean[]) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  v_n integer := coalesce(array_length(p_key, 1), 0);
  v_i integer := 1;
  v_locked bigint;
  v_out text := '[';
BEGIN
  SELECT count(*) INTO v_locked
    FROM (SELECT 1 FROM memories WHERE memory_id = ANY(p_memory) ORDER BY memory_id FOR UPDATE) AS l;
  LOOP
    EXIT WHEN v_i > v_n;
    IF v_i > 1 THEN
      v_out := v_out || ',';
    END IF;
    v_out := v_out || mep_claim_t(p_tenant[v_i], p_key[v_i], p_fp[v_i], p_request_id[v_i], p_pre[v_i]::jsonb,
                                  p_name[v_i], p_display[v_i], p_skeleton[v_i], p_memory[v_i], p_owner[v_i],
                                  p_ttl[v_i], p_lease_id[v_i], p_unicode, p_icu, p_ticket[v_i], p_bound,
                                  p_event[v_i], p_name_hash[v_i], p_memory_hash[v_i], p_keep_refusal[v_i]);
    v_i := v_i + 1;
  END LOOP;
  RETURN v_out || ']';
END
$$;
)sql";

// Version 11: renewals in one UPDATE. v8's mep_renew_batch called mep_renew_one, a function
// and a statement, for each lease: most of a batch's database CPU went to setting up those
// statements, not to the rows. mep_renew_many takes the renewals of several requests (a
// server sends the single renewals queued together in one call, as it does claims), and
// mep_release_many the releases.
const std::string_view k_pg_schema_v11 = R"sql(
-- The i-th of each array is one renewal, of tenant p_tenants[i] (mep_renew_one's parameters;
-- p_request_ids[i] goes into its problem). Answers a JSON array of mep_renew_one's answers,
-- in order. When no lease appears twice, one UPDATE renews every item with a valid TTL whose
-- lease matches; each item it did not renew (stale, expired, released, another's, a bad TTL)
-- is then answered by mep_renew_one, which classifies it. A call that names a lease twice
-- goes item by item, as v8's mep_renew_batch did, so that each item sees the ones before it.
CREATE OR REPLACE FUNCTION mep_renew_many(p_tenants text[], p_names text[], p_memories text[],
    p_tokens bigint[], p_owners text[], p_ttls bigint[], p_request_ids text[], p_bound bigint) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_take bigint := least(v_now, coalesce(p_bound, v_now));
  v_n integer := coalesce(array_length(p_names, 1), 0);
  v_exp bigint[];
  v_out jsonb;
BEGIN
  IF v_n > 0 AND (SELECT count(DISTINCT m) FROM unnest(p_memories) m) = v_n THEN
    -- (memory_id = ANY: should the planner ever take leases first, it reads only the
    -- call's rows, by a unique index.)
    WITH r AS (
      UPDATE leases l SET expires_at = greatest(l.expires_at, v_now + b.ttl * 1000), ttl_seconds = b.ttl
        FROM unnest(p_tenants, p_names, p_memories, p_tokens, p_owners, p_ttls) WITH ORDINALITY
             AS b(tenant, n, m, t, o, ttl, i)
       WHERE l.memory_id = ANY(p_memories) AND l.memory_id = b.m AND b.ttl BETWEEN 5 AND 300
         AND l.fencing_token = b.t AND l.tenant_id = b.tenant AND l.canonical_name = b.n
         AND l.owner_client_id = b.o
         AND (l.expires_at > v_take OR mep_step_held(l.expires_at, l.ttl_seconds, v_now))
      RETURNING b.i, l.expires_at)
    SELECT array_agg(r.expires_at ORDER BY g) INTO v_exp
      FROM generate_series(1, v_n) AS g LEFT JOIN r ON r.i = g;
  END IF;
  SELECT coalesce(jsonb_agg(CASE WHEN v_exp[g] IS NOT NULL
                                 THEN jsonb_build_object('expires_at', v_exp[g], 'ttl_seconds', p_ttls[g],
                                                         'server_time', v_now)
                                 ELSE mep_renew_one(p_tenants[g], p_names[g], p_memories[g], p_tokens[g],
                                                    p_owners[g], p_ttls[g], v_now, v_take, p_request_ids[g]) END
                            ORDER BY g), '[]'::jsonb)
    INTO v_out
    FROM generate_series(1, v_n) AS g;
  RETURN v_out;
END
$$;

-- The i-th of each array is one release (mep_release's parameters). Answers a JSON array of
-- mep_release's answers, in order, as if each had been called alone. When no lease appears
-- twice, one DELETE ends every live lease that matches and audits it; each item it did not
-- end is then answered by mep_release, which classifies it (and ends an expired lease).
CREATE OR REPLACE FUNCTION mep_release_many(p_tenants text[], p_names text[], p_memories text[],
    p_tokens bigint[], p_owners text[], p_request_ids text[]) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_n integer := coalesce(array_length(p_names, 1), 0);
  v_done boolean[];
  v_out jsonb;
BEGIN
  IF v_n > 0 AND (SELECT count(DISTINCT m) FROM unnest(p_memories) m) = v_n THEN
    WITH d AS (
      DELETE FROM leases l
       USING unnest(p_tenants, p_names, p_memories, p_tokens, p_owners) WITH ORDINALITY AS b(tenant, n, m, t, o, i)
       WHERE l.memory_id = ANY(p_memories) AND l.memory_id = b.m AND l.fencing_token = b.t
         AND l.tenant_id = b.tenant AND l.canonical_name = b.n AND l.owner_client_id = b.o
         AND (l.expires_at > v_now OR mep_step_held(l.expires_at, l.ttl_seconds, v_now))
      RETURNING b.i, l.tenant_id, l.canonical_name, l.memory_id, l.fencing_token, l.name_hash, l.memory_hash),
    a AS (
      INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash, redacted_memory_hash,
                               fencing_token, created_at)
      SELECT mep_uuid7(v_now), d.tenant_id, 'LEASE_RELEASED',
             coalesce(d.name_hash, mep_hash(d.tenant_id, d.canonical_name)),
             coalesce(d.memory_hash, mep_hash(d.tenant_id, d.memory_id)), d.fencing_token, v_now
        FROM d)
    SELECT array_agg(d.i IS NOT NULL ORDER BY g) INTO v_done
      FROM generate_series(1, v_n) AS g LEFT JOIN d ON d.i = g;
  END IF;
  SELECT coalesce(jsonb_agg(CASE WHEN v_done[g] THEN '{"outcome": "released"}'::jsonb
                                 ELSE mep_release(p_tenants[g], p_names[g], p_memories[g], p_tokens[g], p_owners[g],
                                                  p_request_ids[g]) END
                            ORDER BY g), '[]'::jsonb)
    INTO v_out
    FROM generate_series(1, v_n) AS g;
  RETURN v_out;
END
$$;

-- A renew-batch request: the renewals of one tenant and one request.
CREATE OR REPLACE FUNCTION mep_renew_batch(p_tenant text, p_names text[], p_memories text[],
    p_tokens bigint[], p_owners text[], p_ttls bigint[], p_request_id text, p_bound bigint) RETURNS jsonb
LANGUAGE sql AS $$
  SELECT mep_renew_many(array_fill(p_tenant, ARRAY[coalesce(array_length(p_names, 1), 0)]), p_names, p_memories,
                        p_tokens, p_owners, p_ttls,
                        array_fill(p_request_id, ARRAY[coalesce(array_length(p_names, 1), 0)]), p_bound)
$$;
)sql";

// Version 12: operating a fleet of leases (issue 54). A lease row says who holds it (holder:
// the JSON a daemon sent, never a path), since when its owner holds it (granted_at: a
// re-claim keeps it), its renewals and when they stop (hold_until, from max_hold_seconds or
// the server's --max-hold). A refusal because a name or memory is held names the holder to a
// requester of its tenant (mep_holder_view). A revocation is remembered on the memory
// (revoked_token, revoke_reason), so that its holder's next renewal learns why its lease
// ended. The audit row that ends a lease carries its renewals. Functions whose signature
// stays are replaced in place (their answers only gain members); the claim is mep_claim_h,
// with the holder and the hold as new parameters, beside v9's mep_claim_t for servers of an
// earlier version during a rolling upgrade.
const std::string_view k_pg_schema_v12 = R"sql(
ALTER TABLE leases ADD COLUMN IF NOT EXISTS holder text;
ALTER TABLE leases ADD COLUMN IF NOT EXISTS granted_at bigint;
ALTER TABLE leases ADD COLUMN IF NOT EXISTS renewed_at bigint;
ALTER TABLE leases ADD COLUMN IF NOT EXISTS renewals bigint NOT NULL DEFAULT 0;
ALTER TABLE leases ADD COLUMN IF NOT EXISTS hold_until bigint;
ALTER TABLE memories ADD COLUMN IF NOT EXISTS revoked_token bigint;
ALTER TABLE memories ADD COLUMN IF NOT EXISTS revoke_reason text;
ALTER TABLE audit_events ADD COLUMN IF NOT EXISTS renewals bigint;

-- What a refusal (423) says of a live lease's holder to a requester of tenant p_tenant:
-- NULL for another tenant's lease. Times in ms; the server renders them.
CREATE OR REPLACE FUNCTION mep_holder_view(p_row_tenant text, p_tenant text, p_display text, p_holder text,
                                           p_since bigint, p_expires bigint) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN p_row_tenant = p_tenant THEN
    jsonb_strip_nulls(jsonb_build_object('display_name', p_display, 'host', p_holder::jsonb->>'host',
                                         'since', p_since, 'expires_at', p_expires)) END
$$;

-- A refusal's extension members: mep_wait_ext's, and the holder when it may be seen.
CREATE OR REPLACE FUNCTION mep_held_ext(p_wait jsonb, p_view jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN p_view IS NULL THEN p_wait
              ELSE jsonb_build_object('ext', coalesce(p_wait->'ext', '{}'::jsonb)
                                             || jsonb_build_object('holder', p_view)) END
$$;

-- v7's, with each row's renewals ('r') on the rows that end a lease.
CREATE OR REPLACE FUNCTION mep_audit_many(p_rows jsonb, p_type text, p_tenant text, p_now bigint)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
  v_n integer;
BEGIN
  WITH ins AS (
    INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash,
                             redacted_memory_hash, fencing_token, created_at, renewals)
    SELECT mep_uuid7(p_now), coalesce(p_tenant, e->>'tenant'), p_type,
           coalesce(CASE WHEN coalesce(p_tenant, e->>'tenant') = e->>'tenant' THEN e->>'nh' END,
                    mep_hash(coalesce(p_tenant, e->>'tenant'), e->>'n')),
           coalesce(CASE WHEN coalesce(p_tenant, e->>'tenant') = e->>'tenant' THEN e->>'mh' END,
                    mep_hash(coalesce(p_tenant, e->>'tenant'), e->>'m')),
           (e->>'t')::bigint, p_now,
           CASE WHEN p_type IN ('LEASE_EXPIRED', 'LEASE_RELEASED', 'LEASE_REVOKED') THEN (e->>'r')::bigint END
      FROM jsonb_array_elements(p_rows) AS e
    RETURNING 1)
  SELECT count(*) INTO v_n FROM ins;
  RETURN v_n;
END
$$;

-- mep_audit_h with the lease's renewals (for the row that ends it).
CREATE OR REPLACE FUNCTION mep_audit_hr(p_event text, p_tenant text, p_type text, p_nh text, p_mh text,
                                        p_name text, p_memory text, p_token bigint, p_now bigint,
                                        p_renewals bigint) RETURNS integer LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash,
                           redacted_memory_hash, fencing_token, created_at, renewals)
  VALUES (coalesce(p_event, mep_uuid7(p_now)), p_tenant, p_type, coalesce(p_nh, mep_hash(p_tenant, p_name)),
          coalesce(p_mh, mep_hash(p_tenant, p_memory)), p_token, p_now, p_renewals);
  RETURN 1;
END
$$;

-- v6's, and a lease an operator revoked says so (reason "revoked", and the operator's words).
CREATE OR REPLACE FUNCTION mep_classify(p_tenant text, p_memory text, p_token bigint, p_now bigint,
                                        p_not_found text, p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_tenant text;
  v_counter bigint;
  v_revoked bigint;
  v_reason text;
  v_token bigint;
  v_expires bigint;
  v_ttl bigint;
  v_n integer;
BEGIN
  SELECT tenant_id, fence_counter, revoked_token, revoke_reason INTO v_tenant, v_counter, v_revoked, v_reason
    FROM memories WHERE memory_id = p_memory;
  IF v_tenant IS DISTINCT FROM p_tenant THEN
    RETURN mep_problem(p_not_found, 'no such memory for this tenant', p_request_id);
  END IF;
  IF p_token <> v_counter THEN
    v_n := mep_audit(p_tenant, 'STALE_FENCE_REJECTED', NULL, p_memory, p_token, p_now);
    IF p_token < v_counter THEN
      RETURN mep_problem('stale-fence', format('fencing token %s was superseded by %s', p_token, v_counter),
                         p_request_id)
             || jsonb_build_object('ext', jsonb_build_object('current_fencing_token', v_counter));
    END IF;
    RETURN mep_problem('stale-fence', format('fencing token %s was never issued for this memory', p_token),
                       p_request_id)
           || jsonb_build_object('ext', jsonb_build_object('current_fencing_token', v_counter));
  END IF;
  SELECT fencing_token, expires_at, ttl_seconds INTO v_token, v_expires, v_ttl FROM leases WHERE memory_id = p_memory;
  IF v_token IS NULL OR v_token <> p_token OR (v_expires <= p_now AND NOT mep_step_held(v_expires, v_ttl, p_now)) THEN
    IF v_revoked = p_token THEN
      RETURN mep_problem('lease-expired',
                         CASE WHEN v_reason IS NULL
                              THEN format('the lease with fencing token %s was revoked by an operator', p_token)
                              ELSE format('the lease with fencing token %s was revoked by an operator: %s', p_token,
                                          v_reason) END, p_request_id)
             || jsonb_build_object('ext', jsonb_build_object('reason', 'revoked'));
    END IF;
    RETURN mep_problem('lease-expired', format('the lease with fencing token %s has ended', p_token),
                       p_request_id);
  END IF;
  RETURN NULL;
END
$$;

-- The refusal of a renewal past the lease's hold limit.
CREATE OR REPLACE FUNCTION mep_max_hold_problem(p_start bigint, p_hold_until bigint, p_request_id text)
RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
  SELECT mep_problem('lease-expired', format('the lease has been held for its longest hold (%s s): renewals stop here',
                                             (p_hold_until - p_start) / 1000), p_request_id)
         || jsonb_build_object('ext', jsonb_build_object('reason', 'max-hold'))
$$;

-- v8's, counting the renewal, and refusing one that would carry the lease past its hold limit.
CREATE OR REPLACE FUNCTION mep_renew_one(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_ttl bigint, p_now bigint, p_take bigint, p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_exp bigint;
  v_problem jsonb;
  v_start bigint;
  v_hold bigint;
BEGIN
  IF p_ttl < 5 OR p_ttl > 300 THEN
    RETURN mep_problem('invalid-ttl', format('ttl_seconds must be between 5 and 300 (got %s)', p_ttl),
                       p_request_id);
  END IF;
  UPDATE leases SET expires_at = greatest(expires_at, p_now + p_ttl * 1000), ttl_seconds = p_ttl,
                    renewed_at = p_now, renewals = renewals + 1
   WHERE memory_id = p_memory AND fencing_token = p_token AND tenant_id = p_tenant
     AND canonical_name = p_name AND owner_client_id = p_owner
     AND (expires_at > p_take OR mep_step_held(expires_at, ttl_seconds, p_now))
     AND (hold_until IS NULL OR p_now + p_ttl * 1000 <= hold_until)
  RETURNING expires_at INTO v_exp;
  IF v_exp IS NOT NULL THEN
    RETURN jsonb_build_object('expires_at', v_exp, 'ttl_seconds', p_ttl, 'server_time', p_now);
  END IF;
  v_problem := mep_classify(p_tenant, p_memory, p_token, p_now, 'lease-not-found', p_request_id);
  IF v_problem IS NOT NULL THEN
    RETURN v_problem;
  END IF;
  SELECT coalesce(granted_at, acquired_at), hold_until INTO v_start, v_hold FROM leases
   WHERE memory_id = p_memory AND fencing_token = p_token AND tenant_id = p_tenant
     AND canonical_name = p_name AND owner_client_id = p_owner;
  IF v_hold IS NOT NULL AND p_now + p_ttl * 1000 > v_hold THEN
    RETURN mep_max_hold_problem(v_start, v_hold, p_request_id);
  END IF;
  RETURN mep_problem('lease-not-found', 'no lease of this owner under this name', p_request_id);
END
$$;

-- v11's, counting the renewals and leaving a lease past its hold limit to mep_renew_one.
CREATE OR REPLACE FUNCTION mep_renew_many(p_tenants text[], p_names text[], p_memories text[],
    p_tokens bigint[], p_owners text[], p_ttls bigint[], p_request_ids text[], p_bound bigint) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_take bigint := least(v_now, coalesce(p_bound, v_now));
  v_n integer := coalesce(array_length(p_names, 1), 0);
  v_exp bigint[];
  v_out jsonb;
BEGIN
  IF v_n > 0 AND (SELECT count(DISTINCT m) FROM unnest(p_memories) m) = v_n THEN
    WITH r AS (
      UPDATE leases l SET expires_at = greatest(l.expires_at, v_now + b.ttl * 1000), ttl_seconds = b.ttl,
                          renewed_at = v_now, renewals = l.renewals + 1
        FROM unnest(p_tenants, p_names, p_memories, p_tokens, p_owners, p_ttls) WITH ORDINALITY
             AS b(tenant, n, m, t, o, ttl, i)
       WHERE l.memory_id = ANY(p_memories) AND l.memory_id = b.m AND b.ttl BETWEEN 5 AND 300
         AND l.fencing_token = b.t AND l.tenant_id = b.tenant AND l.canonical_name = b.n
         AND l.owner_client_id = b.o
         AND (l.expires_at > v_take OR mep_step_held(l.expires_at, l.ttl_seconds, v_now))
         AND (l.hold_until IS NULL OR v_now + b.ttl * 1000 <= l.hold_until)
      RETURNING b.i, l.expires_at)
    SELECT array_agg(r.expires_at ORDER BY g) INTO v_exp
      FROM generate_series(1, v_n) AS g LEFT JOIN r ON r.i = g;
  END IF;
  SELECT coalesce(jsonb_agg(CASE WHEN v_exp[g] IS NOT NULL
                                 THEN jsonb_build_object('expires_at', v_exp[g], 'ttl_seconds', p_ttls[g],
                                                         'server_time', v_now)
                                 ELSE mep_renew_one(p_tenants[g], p_names[g], p_memories[g], p_tokens[g],
                                                    p_owners[g], p_ttls[g], v_now, v_take, p_request_ids[g]) END
                            ORDER BY g), '[]'::jsonb)
    INTO v_out
    FROM generate_series(1, v_n) AS g;
  RETURN v_out;
END
$$;

-- How a lease ended, for the server's metrics: {c: cause, h: ms held}. An expiry of a lease
-- whose renewals its hold limit refused counts as max_hold.
CREATE OR REPLACE FUNCTION mep_end(p_cause text, p_end bigint, p_start bigint, p_expires bigint, p_ttl bigint,
                                   p_hold bigint) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
  SELECT jsonb_build_object('c', CASE WHEN p_cause IN ('expired', 'taken_over') AND p_hold IS NOT NULL
                                           AND p_expires + p_ttl * 1000 > p_hold THEN 'max_hold' ELSE p_cause END,
                            'h', greatest(0, p_end - p_start))
$$;

-- v7's, auditing the renewals of the lease it ends and saying how it ended ("end").
CREATE OR REPLACE FUNCTION mep_release(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_request_id text) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_tenant text;
  v_name text;
  v_nh text;
  v_mh text;
  v_r bigint;
  v_start bigint;
  v_expires bigint;
  v_ttl bigint;
  v_hold bigint;
  v_problem jsonb;
  v_n integer;
BEGIN
  DELETE FROM leases
   WHERE memory_id = p_memory AND fencing_token = p_token AND tenant_id = p_tenant
     AND canonical_name = p_name AND owner_client_id = p_owner
     AND (expires_at > v_now OR mep_step_held(expires_at, ttl_seconds, v_now))
  RETURNING canonical_name, name_hash, memory_hash, renewals, coalesce(granted_at, acquired_at)
    INTO v_name, v_nh, v_mh, v_r, v_start;
  IF v_name IS NOT NULL THEN
    v_n := mep_audit_hr(NULL, p_tenant, 'LEASE_RELEASED', v_nh, v_mh, v_name, p_memory, p_token, v_now, v_r);
    RETURN jsonb_build_object('outcome', 'released', 'end', mep_end('released', v_now, v_start, 0, 0, NULL));
  END IF;
  v_problem := mep_classify(p_tenant, p_memory, p_token, v_now, 'lease-not-found', p_request_id);
  IF v_problem IS NULL THEN
    RETURN mep_problem('lease-not-found', 'no lease of this owner under this name', p_request_id);
  END IF;
  IF v_problem->>'code' <> 'lease-expired' THEN
    RETURN v_problem;
  END IF;
  DELETE FROM leases WHERE memory_id = p_memory AND fencing_token = p_token AND expires_at <= v_now
  RETURNING tenant_id, canonical_name, name_hash, memory_hash, renewals, coalesce(granted_at, acquired_at),
            expires_at, ttl_seconds, hold_until
    INTO v_tenant, v_name, v_nh, v_mh, v_r, v_start, v_expires, v_ttl, v_hold;
  IF v_name IS NOT NULL THEN
    v_n := mep_audit_hr(NULL, v_tenant, 'LEASE_EXPIRED', v_nh, v_mh, v_name, p_memory, p_token, v_now, v_r);
    RETURN jsonb_build_object('outcome', 'released',
                              'end', mep_end('expired', v_expires, v_start, v_expires, v_ttl, v_hold));
  END IF;
  RETURN '{"outcome": "released"}'::jsonb;
END
$$;

-- v11's, auditing the renewals and saying how each lease ended.
CREATE OR REPLACE FUNCTION mep_release_many(p_tenants text[], p_names text[], p_memories text[],
    p_tokens bigint[], p_owners text[], p_request_ids text[]) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_n integer := coalesce(array_length(p_names, 1), 0);
  v_done bigint[];
  v_out jsonb;
BEGIN
  IF v_n > 0 AND (SELECT count(DISTINCT m) FROM unnest(p_memories) m) = v_n THEN
    WITH d AS (
      DELETE FROM leases l
       USING unnest(p_tenants, p_names, p_memories, p_tokens, p_owners) WITH ORDINALITY AS b(tenant, n, m, t, o, i)
       WHERE l.memory_id = ANY(p_memories) AND l.memory_id = b.m AND l.fencing_token = b.t
         AND l.tenant_id = b.tenant AND l.canonical_name = b.n AND l.owner_client_id = b.o
         AND (l.expires_at > v_now OR mep_step_held(l.expires_at, l.ttl_seconds, v_now))
      RETURNING b.i, l.tenant_id, l.canonical_name, l.memory_id, l.fencing_token, l.name_hash, l.memory_hash,
                l.renewals, coalesce(l.granted_at, l.acquired_at) AS start),
    a AS (
      INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash, redacted_memory_hash,
                               fencing_token, created_at, renewals)
      SELECT mep_uuid7(v_now), d.tenant_id, 'LEASE_RELEASED',
             coalesce(d.name_hash, mep_hash(d.tenant_id, d.canonical_name)),
             coalesce(d.memory_hash, mep_hash(d.tenant_id, d.memory_id)), d.fencing_token, v_now, d.renewals
        FROM d)
    SELECT array_agg(d.start ORDER BY g) INTO v_done
      FROM generate_series(1, v_n) AS g LEFT JOIN d ON d.i = g;
  END IF;
  SELECT coalesce(jsonb_agg(CASE WHEN v_done[g] IS NOT NULL
                                 THEN jsonb_build_object('outcome', 'released',
                                                         'end', mep_end('released', v_now, v_done[g], 0, 0, NULL))
                                 ELSE mep_release(p_tenants[g], p_names[g], p_memories[g], p_tokens[g], p_owners[g],
                                                  p_request_ids[g]) END
                            ORDER BY g), '[]'::jsonb)
    INTO v_out
    FROM generate_series(1, v_n) AS g;
  RETURN v_out;
END
$$;

-- v4's, remembering the revocation on the memory (and the operator's reason), auditing the
-- lease's renewals and saying how long it was held.
CREATE OR REPLACE FUNCTION mep_revoke_r(p_tenant text, p_name text, p_reason text, p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_name text;
  v_memory text;
  v_token bigint;
  v_r bigint;
  v_start bigint;
  v_n integer;
BEGIN
  DELETE FROM leases WHERE canonical_name = p_name AND tenant_id = p_tenant AND expires_at > v_now
  RETURNING canonical_name, memory_id, fencing_token, renewals, coalesce(granted_at, acquired_at)
    INTO v_name, v_memory, v_token, v_r, v_start;
  IF v_name IS NULL THEN
    RETURN mep_problem('lease-not-found', 'no live lease under this name', p_request_id);
  END IF;
  UPDATE memories SET revoked_token = v_token, revoke_reason = nullif(p_reason, '') WHERE memory_id = v_memory;
  v_n := mep_audit_hr(NULL, p_tenant, 'LEASE_REVOKED', NULL, NULL, v_name, v_memory, v_token, v_now, v_r);
  PERFORM pg_notify('mep_lease_freed', v_name || chr(9) || v_memory);
  RETURN jsonb_build_object('outcome', 'revoked', 'canonical_name', v_name, 'memory_instance_id', v_memory,
                            'end', mep_end('revoked', v_now, v_start, 0, 0, NULL));
END
$$;

-- v7's sweep, auditing each expired lease's renewals and answering what it removed and how
-- each lease ended: {"removed": n, "ends": [{c, h}, …]}.
CREATE OR REPLACE FUNCTION mep_sweep_r(p_bound bigint) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_take bigint := least(v_now, coalesce(p_bound, v_now));
  v_expired jsonb;
  v_ends jsonb;
  v_n integer := 0;
  v_c bigint;
BEGIN
  WITH d AS (
    DELETE FROM leases WHERE lease_id IN
      (SELECT lease_id FROM leases WHERE expires_at <= v_take LIMIT 1000 FOR UPDATE SKIP LOCKED)
      AND expires_at <= v_take AND NOT mep_step_held(expires_at, ttl_seconds, v_now)
    RETURNING tenant_id, canonical_name, memory_id, fencing_token, name_hash, memory_hash, renewals,
              mep_end('expired', expires_at, coalesce(granted_at, acquired_at), expires_at, ttl_seconds,
                      hold_until) AS e)
  SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object('tenant', tenant_id, 'n', canonical_name,
                     'm', memory_id, 't', fencing_token, 'nh', name_hash, 'mh', memory_hash, 'r', renewals))),
         jsonb_agg(e)
    INTO v_expired, v_ends FROM d;
  IF v_expired IS NOT NULL THEN
    v_n := mep_audit_many(v_expired, 'LEASE_EXPIRED', NULL, v_now);
  END IF;
  WITH d AS (
    DELETE FROM idempotency WHERE (tenant_id, idem_key) IN
      (SELECT tenant_id, idem_key FROM idempotency WHERE expires_at <= v_now LIMIT 5000 FOR UPDATE SKIP LOCKED)
      AND expires_at <= v_now
    RETURNING 1)
  SELECT count(*) INTO v_c FROM d;
  RETURN jsonb_build_object('removed', v_n + v_c, 'ends', coalesce(v_ends, '[]'::jsonb))::text;
END
$$;
CREATE OR REPLACE FUNCTION mep_sweep(p_bound bigint) RETURNS bigint LANGUAGE sql AS $$
  SELECT (mep_sweep_r(p_bound)::jsonb->>'removed')::bigint
$$;

-- SPEC §6.1: the atomic claim, as v9's mep_claim_t (its parameters are described there), with
-- the holder (p_holder: JSON text) and the hold (p_max_hold, seconds; NULL: none).
CREATE OR REPLACE FUNCTION mep_claim_h(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text, p_ticket bigint, p_bound bigint,
    p_event text, p_name_hash text, p_memory_hash text, p_holder text, p_max_hold bigint,
    p_keep_refusal boolean) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_nh text := coalesce(p_name_hash, mep_hash(p_tenant, p_name));
  v_mh text := coalesce(p_memory_hash, mep_hash(p_tenant, p_memory));
  v_take bigint;
  v_fp text;
  v_status integer;
  v_body text;
  v_waiting bigint;
  v_waiting_alive bigint;
  v_mem_tenant text;
  v_counter bigint;
  v_expired jsonb;
  v_all_expired jsonb;
  v_takeable bigint;
  v_reclaim_id text;
  v_name_held bigint;
  v_name_expires bigint;
  v_skel_held bigint;
  v_skel_expires bigint;
  v_held_id text;
  v_held_expires bigint;
  v_inserted text;
  v_granted_at bigint;
  v_token bigint;
  v_lease_id text;
  v_attempt integer := 0;
  v_pass integer;
  v_result text;
  v_t bigint;
  v_stored text;
  v_n integer;
  v_row_id text;
  v_own boolean;
  v_clear boolean;
  v_name_view jsonb;
  v_skel_view jsonb;
  v_held_view jsonb;
  v_start bigint;
  v_expires bigint;
  v_ends text;
BEGIN
  -- The memory, locked against concurrent claims, and the outcome stored under the key, if
  -- any, in one statement (each statement has a cost of its own). A call with a problem
  -- found before it (p_pre), or for a memory that does not exist, looks up the key alone.
  IF p_pre IS NULL THEN
    SELECT m.tenant_id, m.fence_counter, i.fingerprint, i.status, i.body
      INTO v_mem_tenant, v_counter, v_fp, v_status, v_body
      FROM memories m LEFT JOIN idempotency i
        ON i.tenant_id = p_tenant AND i.idem_key = p_key AND i.expires_at > v_now
     WHERE m.memory_id = p_memory FOR UPDATE OF m;
  END IF;
  IF v_mem_tenant IS NULL THEN
    SELECT fingerprint, status, body INTO v_fp, v_status, v_body FROM idempotency
     WHERE tenant_id = p_tenant AND idem_key = p_key AND expires_at > v_now;
  END IF;
  -- Replayed (or 422 for another request).
  IF v_fp IS NOT NULL THEN
    IF v_fp <> p_fp THEN
      RETURN jsonb_build_object('status', 422, 'replayed', false, 'result',
               mep_problem('idempotency-key-reused', 'this Idempotency-Key was used with a different request',
                           p_request_id))::text;
    END IF;
    RETURN '{"status": ' || v_status || ', "replayed": true, "result": ' || v_body || '}';
  END IF;
  IF p_pre IS NOT NULL THEN
    RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 400, p_pre)::text;
  END IF;
  -- The memory exists and is the tenant's.
  IF v_mem_tenant IS DISTINCT FROM p_tenant THEN
    RETURN mep_idem_put(p_tenant, p_key, p_fp, v_now, 404,
                        mep_problem('memory-not-found', 'no such memory for this tenant', p_request_id))::text;
  END IF;
  LOOP
    -- The time is read after the memory lock (and again after a lost race), so it is later
    -- than the commit of every grant and release this claim observes.
    v_now := mep_now_ms();
    v_take := least(v_now, coalesce(p_bound, v_now));
    v_pass := 0;
    -- The common cases first, by the unique indexes alone: the caller's own live lease
    -- under this name (a re-claim: no other row can share its name, skeleton or memory), or
    -- no lease on the name, the skeleton or the memory at all. Anything else, below.
    SELECT lease_id, (tenant_id = p_tenant AND owner_client_id = p_owner AND memory_id = p_memory
                      AND skeleton = p_skeleton AND expires_at > v_take)
      INTO v_row_id, v_own FROM leases WHERE canonical_name = p_name;
    IF v_row_id IS NULL THEN
      SELECT lease_id INTO v_row_id FROM leases WHERE skeleton = p_skeleton OR memory_id = p_memory LIMIT 1;
      v_clear := v_row_id IS NULL;
    ELSE
      v_clear := v_own;
    END IF;
    IF v_clear THEN
      v_reclaim_id := v_row_id; -- NULL when no row shares anything
      v_name_held := 0;
      v_skel_held := 0;
      v_held_id := NULL;
      v_name_view := NULL;
      v_skel_view := NULL;
      v_held_view := NULL;
    END IF;
    LOOP
      EXIT WHEN v_clear;
      -- The rows that share the name, the skeleton or the memory (at most three): how many
      -- have expired and may be taken over; the caller's own live lease under this name (a
      -- re-claim); anyone else's lease on the name, on the skeleton, on the memory.
      SELECT count(*) FILTER (WHERE expires_at <= v_take AND NOT mep_step_held(expires_at, ttl_seconds, v_now)),
             min(lease_id) FILTER (WHERE r),
             count(*) FILTER (WHERE canonical_name = p_name AND NOT r),
             min(expires_at) FILTER (WHERE canonical_name = p_name AND NOT r),
             count(*) FILTER (WHERE skeleton = p_skeleton AND canonical_name <> p_name AND NOT r),
             min(expires_at) FILTER (WHERE skeleton = p_skeleton AND canonical_name <> p_name AND NOT r),
             min(lease_id) FILTER (WHERE memory_id = p_memory AND NOT r),
             min(expires_at) FILTER (WHERE memory_id = p_memory AND NOT r),
             (array_agg(v) FILTER (WHERE canonical_name = p_name AND NOT r))[1],
             (array_agg(v) FILTER (WHERE skeleton = p_skeleton AND canonical_name <> p_name AND NOT r))[1],
             (array_agg(v) FILTER (WHERE memory_id = p_memory AND NOT r))[1]
        INTO v_takeable, v_reclaim_id, v_name_held, v_name_expires, v_skel_held, v_skel_expires,
             v_held_id, v_held_expires, v_name_view, v_skel_view, v_held_view
        FROM (SELECT l.*, (l.canonical_name = p_name AND l.tenant_id = p_tenant AND l.owner_client_id = p_owner
                           AND l.memory_id = p_memory) AS r,
                     mep_holder_view(l.tenant_id, p_tenant, l.display_name, l.holder,
                                     coalesce(l.granted_at, l.acquired_at), l.expires_at) AS v
                FROM leases l
               WHERE l.canonical_name = p_name OR l.skeleton = p_skeleton OR l.memory_id = p_memory) AS c;
      EXIT WHEN v_takeable = 0;
      -- Takeover: expired leases conflicting on name, skeleton or memory go (SPEC §12.2), by
      -- the database clock and by the bound the server's monotonic clock sets on it, and not
      -- while a step of the clock holds them back.
      v_pass := v_pass + 1;
      IF v_pass > 3 THEN
        RAISE EXCEPTION 'claim kept finding expired leases to take over' USING ERRCODE = '40001';
      END IF;
      WITH d AS (
        DELETE FROM leases
         WHERE (canonical_name = p_name OR skeleton = p_skeleton OR memory_id = p_memory)
           AND expires_at <= v_take AND NOT mep_step_held(expires_at, ttl_seconds, v_now)
        RETURNING tenant_id, canonical_name, memory_id, fencing_token, name_hash, memory_hash, renewals,
                  expires_at - coalesce(granted_at, acquired_at) AS held,
                  (hold_until IS NOT NULL AND expires_at + ttl_seconds * 1000 > hold_until) AS capped)
      SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object('tenant', tenant_id, 'n', canonical_name,
                         'm', memory_id, 't', fencing_token, 'nh', name_hash, 'mh', memory_hash, 'r', renewals,
                         'h', held, 'x', capped)))
        INTO v_expired FROM d;
      IF v_expired IS NOT NULL THEN
        v_n := mep_audit_many(v_expired, 'LEASE_EXPIRED', NULL, v_now);
        v_all_expired := coalesce(v_all_expired, '[]'::jsonb) || v_expired;
      END IF;
    END LOOP;
    IF v_name_held > 0 OR v_skel_held > 0 THEN
      v_n := mep_audit_h(p_event, p_tenant, 'NAME_CONFLICT', v_nh, v_mh, p_name, p_memory, NULL, v_now);
      IF v_name_held > 0 THEN
        RETURN mep_idem_answer(p_keep_refusal, p_tenant, p_key, p_fp, v_now, 423,
                 mep_problem('name-held', format('the name "%s" is held by another owner', p_name), p_request_id)
                 || jsonb_build_object('retry_after', mep_retry_after(v_name_expires, v_now))
                 || mep_held_ext(mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now), v_name_view));
      END IF;
      RETURN mep_idem_answer(p_keep_refusal, p_tenant, p_key, p_fp, v_now, 423,
               mep_problem('name-confusable',
                           format('the name "%s" is confusable with a name that is held', p_name), p_request_id)
               || jsonb_build_object('retry_after', mep_retry_after(v_skel_expires, v_now))
               || mep_held_ext(mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now), v_skel_view));
    END IF;
    -- A live lease on the memory under another name or owner.
    IF v_held_id IS NOT NULL THEN
      RETURN mep_idem_answer(p_keep_refusal, p_tenant, p_key, p_fp, v_now, 423,
               mep_problem('memory-attached', 'this memory is attached to another lease', p_request_id)
               || jsonb_build_object('retry_after', mep_retry_after(v_held_expires, v_now))
               || mep_held_ext(mep_wait_ext(p_skeleton, p_memory, p_ticket, v_now), v_held_view));
    END IF;
    -- Claims waiting for the skeleton or the memory come first: any of them for a claim
    -- that does not wait (p_ticket NULL), the earlier ones for a waiting claim. A re-claim
    -- of the caller's own live lease holds no one up and is not held up.
    -- (Inline rather than a function of its own: every claim that starts a lease runs it.)
    IF v_reclaim_id IS NULL THEN
      SELECT count(*), min(alive_until) INTO v_waiting, v_waiting_alive FROM mep_waiters
       WHERE (skeleton = p_skeleton OR memory_id = p_memory) AND (p_ticket IS NULL OR waiter_id < p_ticket)
         AND NOT abandoned AND alive_until > v_now;
      IF v_waiting > 0 THEN
        RETURN mep_idem_answer(p_keep_refusal, p_tenant, p_key, p_fp, v_now, 423,
                 mep_problem('name-held', 'the name or the memory is free, but earlier claims are waiting for it',
                             p_request_id)
                 || jsonb_build_object('retry_after', mep_retry_after(v_waiting_alive, v_now),
                                       'ext', jsonb_build_object('waiters', v_waiting)));
      END IF;
    END IF;
    -- Grant.
    v_token := v_counter + 1;
    IF v_reclaim_id IS NOT NULL THEN
      -- A re-claim: the caller's own row, under the memory's lock, takes the new grant. It
      -- waits for no other claim, so its stamp needs no second look (below).
      v_lease_id := v_reclaim_id;
      v_t := mep_now_ms();
      -- It keeps its start, its renewals and its hold limit; past that limit it is refused.
      SELECT coalesce(granted_at, acquired_at) INTO v_start FROM leases WHERE lease_id = v_lease_id;
      IF p_max_hold IS NOT NULL AND v_start + p_max_hold * 1000 <= v_t THEN
        RETURN mep_idem_answer(true, p_tenant, p_key, p_fp, v_now, 410,
                 mep_problem('lease-expired', format('the lease has been held for its longest hold (%s s): '
                                                     'renewals stop here', p_max_hold), p_request_id)
                 || jsonb_build_object('ext', jsonb_build_object('reason', 'max-hold')));
      END IF;
      UPDATE leases SET display_name = p_display, fencing_token = v_token, ttl_seconds = p_ttl,
                        acquired_at = v_t, name_hash = v_nh, memory_hash = v_mh, holder = p_holder,
                        granted_at = v_start, hold_until = v_start + p_max_hold * 1000,
                        expires_at = least(v_t + p_ttl * 1000, coalesce(v_start + p_max_hold * 1000, v_t + p_ttl * 1000))
       WHERE lease_id = v_lease_id
      RETURNING lease_id, acquired_at, expires_at INTO v_inserted, v_granted_at, v_expires;
      EXIT WHEN v_inserted IS NOT NULL;
      -- Released meanwhile: look again.
    ELSE
      v_lease_id := p_lease_id;
      v_t := mep_now_ms();
      -- The grant is stamped when its row goes in. An insert may wait at the unique index
      -- for a concurrent claim of the name, which may commit and be released meanwhile; a
      -- stamp taken before that wait would date the grant before that release. So the
      -- clock is read again after the insert and, if it moved, the row is restamped. Either
      -- stamp is earlier than the commit, so the expiry never outlasts grant + TTL.
      INSERT INTO leases(lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id,
                         fencing_token, owner_client_id, ttl_seconds, expires_at, acquired_at, name_hash, memory_hash,
                         holder, granted_at, hold_until)
      VALUES (v_lease_id, p_tenant, p_name, p_display, p_skeleton, p_memory, v_token, p_owner, p_ttl,
             v_t + least(p_ttl * 1000, coalesce(p_max_hold * 1000, p_ttl * 1000)), v_t, v_nh, v_mh,
             p_holder, v_t, v_t + p_max_hold * 1000)
      ON CONFLICT DO NOTHING
      RETURNING lease_id, acquired_at INTO v_inserted, v_granted_at;
      IF v_inserted IS NOT NULL THEN
        v_now := mep_now_ms();
        IF v_now <> v_granted_at THEN
          v_granted_at := v_now;
          UPDATE leases SET acquired_at = v_granted_at, granted_at = v_granted_at,
                            expires_at = v_granted_at + least(p_ttl * 1000, coalesce(p_max_hold * 1000, p_ttl * 1000)),
                            hold_until = v_granted_at + p_max_hold * 1000
           WHERE lease_id = v_lease_id;
        END IF;
        v_expires := v_granted_at + least(p_ttl * 1000, coalesce(p_max_hold * 1000, p_ttl * 1000));
        EXIT;
      END IF;
      -- A concurrent claim took the name or skeleton and committed: look again.
    END IF;
    v_attempt := v_attempt + 1;
    IF v_attempt >= 3 THEN
      RAISE EXCEPTION 'claim lost a race for its name' USING ERRCODE = '40001';
    END IF;
  END LOOP;
  v_now := v_granted_at;
  IF p_ticket IS NOT NULL THEN
    DELETE FROM mep_waiters WHERE waiter_id = p_ticket;
  END IF;
  IF v_all_expired IS NOT NULL THEN
    v_n := mep_audit_many(v_all_expired, 'LEASE_TAKEOVER', p_tenant, v_now);
    SELECT string_agg(jsonb_build_object('c', CASE WHEN (e->>'x')::boolean THEN 'max_hold' ELSE 'taken_over' END,
                                         'h', (e->>'h')::bigint)::text, ',')
      INTO v_ends FROM jsonb_array_elements(v_all_expired) AS e;
  END IF;
  v_result := '{"lease_id": ' || to_json(v_lease_id) || ', "canonical_name": ' || to_json(p_name)
    || ', "display_name": ' || to_json(p_display) || ', "memory_instance_id": ' || to_json(p_memory)
    || ', "fencing_token": ' || v_token || ', "expires_at": ' || v_expires
    || ', "ttl_seconds": ' || p_ttl || ', "server_time": ' || v_granted_at || ', "outcome": '
    || CASE WHEN v_reclaim_id IS NOT NULL THEN '"reclaimed"}' ELSE '"granted"}' END;
  -- The rest of the grant in one statement (each statement has a cost of its own): the
  -- memory's counter, the name's history, the audit row, and the outcome under the key
  -- (mep_idem_put's rule: a key taken meanwhile rolls the call back, to be replayed).
  -- (The history row is rewritten on every grant: a WHERE that skipped unchanged rows, as
  -- the SQLite backend does, cost more, since ON CONFLICT still locks the row it skips.)
  WITH m AS (UPDATE memories SET fence_counter = v_token WHERE memory_id = p_memory),
       n AS (INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version,
                                     icu_version, first_claimed_at, last_claimed_at)
             VALUES (p_name, p_display, p_skeleton, p_tenant, p_unicode, p_icu, v_granted_at, v_granted_at)
             ON CONFLICT (canonical_name) DO UPDATE
               SET display_name = excluded.display_name, skeleton = excluded.skeleton,
                   tenant_id = excluded.tenant_id, unicode_version = excluded.unicode_version,
                   icu_version = excluded.icu_version, last_claimed_at = excluded.last_claimed_at),
       a AS (INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash,
                                      redacted_memory_hash, fencing_token, created_at)
             VALUES (coalesce(p_event, mep_uuid7(v_now)), p_tenant, 'LEASE_ACQUIRED', v_nh, v_mh, v_token, v_now))
  INSERT INTO idempotency AS i (tenant_id, idem_key, fingerprint, status, body, created_at, expires_at)
  VALUES (p_tenant, p_key, p_fp, 201, v_result, v_now, v_now + 86400000)
  ON CONFLICT (tenant_id, idem_key) DO UPDATE
    SET fingerprint = excluded.fingerprint, status = excluded.status, body = excluded.body,
        created_at = excluded.created_at, expires_at = excluded.expires_at
    WHERE i.expires_at <= v_now
  RETURNING i.idem_key INTO v_stored;
  IF v_stored IS NULL THEN
    RAISE EXCEPTION 'a concurrent call stored an outcome under this Idempotency-Key' USING ERRCODE = '40001';
  END IF;
  -- The leases this grant took over, for the server's metrics (not stored under the key).
  RETURN '{"status": 201, "replayed": false, "ends": [' || coalesce(v_ends, '') || '], "result": ' || v_result || '}';
END
$$;


-- v10's batch of claims, with the holders and holds.
CREATE OR REPLACE FUNCTION mep_claim_batch_h(p_tenant text[], p_key text[], p_fp text[], p_request_id text[],
    p_pre text[], p_name text[], p_display text[], p_skeleton text[], p_memory text[], p_owner text[],
    p_ttl bigint[], p_lease_id text[], p_unicode text, p_icu text, p_ticket bigint[], p_bound bigint,
    p_event text[], p_name_hash text[], p_memory_hash text[], p_holder text[], p_max_hold bigint[],
    p_keep_refusal boolean[]) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  v_n integer := coalesce(array_length(p_key, 1), 0);
  v_i integer := 1;
  v_locked bigint;
  v_out text := '[';
BEGIN
  SELECT count(*) INTO v_locked
    FROM (SELECT 1 FROM memories WHERE memory_id = ANY(p_memory) ORDER BY memory_id FOR UPDATE) AS l;
  LOOP
    EXIT WHEN v_i > v_n;
    IF v_i > 1 THEN
      v_out := v_out || ',';
    END IF;
    v_out := v_out || mep_claim_h(p_tenant[v_i], p_key[v_i], p_fp[v_i], p_request_id[v_i], p_pre[v_i]::jsonb,
                                  p_name[v_i], p_display[v_i], p_skeleton[v_i], p_memory[v_i], p_owner[v_i],
                                  p_ttl[v_i], p_lease_id[v_i], p_unicode, p_icu, p_ticket[v_i], p_bound,
                                  p_event[v_i], p_name_hash[v_i], p_memory_hash[v_i], p_holder[v_i],
                                  p_max_hold[v_i], p_keep_refusal[v_i]);
    v_i := v_i + 1;
  END LOOP;
  RETURN v_out || ']';
END
$$;
)sql";

} // namespace mep::server
