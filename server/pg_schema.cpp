// The PostgreSQL schema (version 1) and the server-side functions through which every
// lease operation is one statement, one round trip and one transaction (SPEC §9).
//
// Why functions: a claim is eight steps with branches (idempotency, memory, takeover, name,
// skeleton, memory attachment, grant, history, audit). As a PL/pgSQL function the whole of
// it runs in one call, rolls back as a whole on any error, and sees each of its own steps.
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
// keys are stored with the tenant, so HMAC is two sha256() calls and no XOR in SQL.
#include <string_view>

namespace mep::server {

extern const std::string_view k_pg_schema_v1;

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

-- The database clock, in Unix milliseconds: the only clock of this backend.
CREATE OR REPLACE FUNCTION mep_now_ms() RETURNS bigint LANGUAGE sql STABLE AS $$
  SELECT floor(extract(epoch FROM now()) * 1000)::bigint
$$;

-- A UUIDv7 (RFC 9562) for the Unix millisecond p_ms.
CREATE OR REPLACE FUNCTION mep_uuid7(p_ms bigint) RETURNS text LANGUAGE sql VOLATILE AS $$
  SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 16, 3) || '-' ||
         substr(r, 20, 4) || '-' || substr(r, 25, 12)
  FROM (SELECT lpad(to_hex(p_ms), 12, '0') AS h, gen_random_uuid()::text AS r) s
$$;

-- Seconds until p_expires, rounded up, at least 1 (Retry-After).
CREATE OR REPLACE FUNCTION mep_retry_after(p_expires bigint, p_now bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
  SELECT greatest(1, (p_expires - p_now + 999) / 1000)
$$;

-- HMAC-SHA256(tenant salt, p_text) in hex; '' for an empty text.
CREATE OR REPLACE FUNCTION mep_hmac(p_tenant text, p_text text) RETURNS text LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN p_text IS NULL OR p_text = '' THEN '' ELSE
    encode(sha256(k.opad || sha256(k.ipad || convert_to(p_text, 'UTF8'))), 'hex') END
  FROM (SELECT coalesce((SELECT audit_opad FROM tenants WHERE tenant_id = p_tenant),
                        decode(repeat('5c', 64), 'hex')) AS opad,
               coalesce((SELECT audit_ipad FROM tenants WHERE tenant_id = p_tenant),
                        decode(repeat('36', 64), 'hex')) AS ipad) k
$$;

CREATE OR REPLACE FUNCTION mep_audit(p_tenant text, p_type text, p_name text, p_memory text,
                                     p_token bigint, p_now bigint) RETURNS void LANGUAGE sql AS $$
  INSERT INTO audit_events(event_id, tenant_id, event_type, redacted_name_hash,
                           redacted_memory_hash, fencing_token, created_at)
  VALUES (mep_uuid7(p_now), p_tenant, p_type, mep_hmac(p_tenant, p_name),
          mep_hmac(p_tenant, p_memory), p_token, p_now)
$$;

-- A problem as the server renders it: code, detail, instance (the request id).
CREATE OR REPLACE FUNCTION mep_problem(p_code text, p_detail text, p_request_id text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
  SELECT jsonb_build_object('code', p_code, 'detail', p_detail, 'instance', p_request_id)
$$;

-- Claims an Idempotency-Key for this call, or answers from it: hit = false means the key
-- is now held by this transaction; hit = true returns the stored outcome (replayed) or a
-- 422 for a different request under the same key (not replayed).
CREATE OR REPLACE FUNCTION mep_idem_begin(p_tenant text, p_key text, p_fp text, p_now bigint,
    p_request_id text, OUT hit boolean, OUT replayed boolean, OUT status integer, OUT result jsonb)
LANGUAGE plpgsql AS $$
DECLARE
  v record;
BEGIN
  hit := false;
  replayed := false;
  INSERT INTO idempotency AS i (tenant_id, idem_key, fingerprint, status, body, created_at, expires_at)
  VALUES (p_tenant, p_key, p_fp, 0, '', p_now, p_now + 86400000)
  ON CONFLICT (tenant_id, idem_key) DO UPDATE
    SET fingerprint = excluded.fingerprint, status = 0, body = '',
        created_at = excluded.created_at, expires_at = excluded.expires_at
    WHERE i.expires_at <= p_now;
  IF FOUND THEN
    RETURN;
  END IF;
  SELECT i.fingerprint, i.status, i.body INTO v
    FROM idempotency i WHERE i.tenant_id = p_tenant AND i.idem_key = p_key;
  hit := true;
  IF v.fingerprint <> p_fp THEN
    status := 422;
    result := mep_problem('idempotency-key-reused',
                          'this Idempotency-Key was used with a different request', p_request_id);
  ELSE
    replayed := true;
    status := v.status;
    result := v.body::jsonb;
  END IF;
END
$$;

CREATE OR REPLACE FUNCTION mep_idem_end(p_tenant text, p_key text, p_status integer, p_result jsonb)
RETURNS void LANGUAGE sql AS $$
  UPDATE idempotency SET status = p_status, body = p_result::text
   WHERE tenant_id = p_tenant AND idem_key = p_key
$$;

-- What a presented (memory, token) refers to: NULL when the token is the memory's current
-- grant and its lease is live; else the problem (p_not_found when the memory is not the
-- tenant's, stale-fence when a newer grant exists or the token was never issued,
-- lease-expired when this grant has ended).
CREATE OR REPLACE FUNCTION mep_classify(p_tenant text, p_memory text, p_token bigint, p_now bigint,
                                        p_not_found text, p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_mem record;
  v_lease record;
BEGIN
  SELECT tenant_id, fence_counter INTO v_mem FROM memories WHERE memory_id = p_memory;
  IF NOT FOUND OR v_mem.tenant_id <> p_tenant THEN
    RETURN mep_problem(p_not_found, 'no such memory for this tenant', p_request_id);
  END IF;
  IF p_token <> v_mem.fence_counter THEN
    PERFORM mep_audit(p_tenant, 'STALE_FENCE_REJECTED', NULL, p_memory, p_token, p_now);
    RETURN mep_problem('stale-fence',
             CASE WHEN p_token < v_mem.fence_counter
                  THEN format('fencing token %s was superseded by %s', p_token, v_mem.fence_counter)
                  ELSE format('fencing token %s was never issued for this memory', p_token) END,
             p_request_id)
           || jsonb_build_object('ext', jsonb_build_object('current_fencing_token', v_mem.fence_counter));
  END IF;
  SELECT fencing_token, expires_at INTO v_lease FROM leases WHERE memory_id = p_memory;
  IF NOT FOUND OR v_lease.fencing_token <> p_token OR v_lease.expires_at <= p_now THEN
    RETURN mep_problem('lease-expired', format('the lease with fencing token %s has ended', p_token),
                       p_request_id);
  END IF;
  RETURN NULL;
END
$$;

-- SPEC §6.1: the atomic claim. p_pre, when given, is a problem found before the call
-- (invalid name or TTL) that is only recorded under the Idempotency-Key and answered.
CREATE OR REPLACE FUNCTION mep_claim(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_pre jsonb, p_name text, p_display text, p_skeleton text, p_memory text, p_owner text,
    p_ttl bigint, p_lease_id text, p_unicode text, p_icu text,
    OUT status integer, OUT result jsonb, OUT replayed boolean)
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_hit record;
  v_mem record;
  v_row record;
  v_reclaim_id text;
  v_held record;
  v_expired jsonb := '[]'::jsonb;
  v_e jsonb;
  v_token bigint;
  v_lease_id text;
  v_attempt integer := 0;
BEGIN
  SELECT * INTO v_hit FROM mep_idem_begin(p_tenant, p_key, p_fp, v_now, p_request_id);
  IF v_hit.hit THEN
    status := v_hit.status; result := v_hit.result; replayed := v_hit.replayed;
    RETURN;
  END IF;
  replayed := false;
  IF p_pre IS NOT NULL THEN
    status := 400; result := p_pre;
    PERFORM mep_idem_end(p_tenant, p_key, status, result);
    RETURN;
  END IF;
  -- The memory exists, is the tenant's, and is locked against concurrent claims.
  SELECT tenant_id, fence_counter INTO v_mem FROM memories WHERE memory_id = p_memory FOR UPDATE;
  IF NOT FOUND OR v_mem.tenant_id <> p_tenant THEN
    status := 404;
    result := mep_problem('memory-not-found', 'no such memory for this tenant', p_request_id);
    PERFORM mep_idem_end(p_tenant, p_key, status, result);
    RETURN;
  END IF;
  LOOP
    -- Takeover: expired leases conflicting on name, skeleton or memory go (SPEC §12.2).
    FOR v_row IN DELETE FROM leases
                  WHERE (canonical_name = p_name OR skeleton = p_skeleton OR memory_id = p_memory)
                    AND expires_at <= v_now
                 RETURNING tenant_id, canonical_name, memory_id, fencing_token LOOP
      PERFORM mep_audit(v_row.tenant_id, 'LEASE_EXPIRED', v_row.canonical_name, v_row.memory_id,
                        v_row.fencing_token, v_now);
      v_expired := v_expired || jsonb_build_array(jsonb_build_object(
                     'n', v_row.canonical_name, 'm', v_row.memory_id, 't', v_row.fencing_token));
    END LOOP;
    -- A live lease on the name or its skeleton: the caller's own (a re-claim) or a conflict.
    v_reclaim_id := NULL;
    FOR v_row IN SELECT lease_id, tenant_id, canonical_name, memory_id, owner_client_id, expires_at
                   FROM leases WHERE canonical_name = p_name OR skeleton = p_skeleton
                  ORDER BY (canonical_name = p_name) DESC LOOP
      IF v_row.canonical_name = p_name AND v_row.tenant_id = p_tenant
         AND v_row.owner_client_id = p_owner AND v_row.memory_id = p_memory THEN
        v_reclaim_id := v_row.lease_id;
        CONTINUE;
      END IF;
      PERFORM mep_audit(p_tenant, 'NAME_CONFLICT', p_name, p_memory, NULL, v_now);
      status := 423;
      IF v_row.canonical_name = p_name THEN
        result := mep_problem('name-held', format('the name "%s" is held by another owner', p_name),
                              p_request_id);
      ELSE
        result := mep_problem('name-confusable',
                    format('the name "%s" is confusable with a name that is held', p_name), p_request_id);
      END IF;
      result := result || jsonb_build_object('retry_after', mep_retry_after(v_row.expires_at, v_now));
      PERFORM mep_idem_end(p_tenant, p_key, status, result);
      RETURN;
    END LOOP;
    -- A live lease on the memory under another name or owner.
    SELECT lease_id, expires_at INTO v_held FROM leases WHERE memory_id = p_memory;
    IF FOUND AND (v_reclaim_id IS NULL OR v_held.lease_id <> v_reclaim_id) THEN
      status := 423;
      result := mep_problem('memory-attached', 'this memory is attached to another lease', p_request_id)
                || jsonb_build_object('retry_after', mep_retry_after(v_held.expires_at, v_now));
      PERFORM mep_idem_end(p_tenant, p_key, status, result);
      RETURN;
    END IF;
    -- Grant.
    v_token := v_mem.fence_counter + 1;
    IF v_reclaim_id IS NOT NULL THEN
      v_lease_id := v_reclaim_id;
      DELETE FROM leases WHERE lease_id = v_lease_id;
    ELSE
      v_lease_id := p_lease_id;
    END IF;
    INSERT INTO leases(lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id,
                       fencing_token, owner_client_id, ttl_seconds, expires_at, acquired_at)
    VALUES (v_lease_id, p_tenant, p_name, p_display, p_skeleton, p_memory, v_token, p_owner, p_ttl,
            v_now + p_ttl * 1000, v_now)
    ON CONFLICT DO NOTHING;
    EXIT WHEN FOUND;
    -- A concurrent claim took the name or skeleton and committed: look again.
    v_attempt := v_attempt + 1;
    IF v_reclaim_id IS NOT NULL OR v_attempt >= 3 THEN
      RAISE EXCEPTION 'claim lost a race for its name' USING ERRCODE = '40001';
    END IF;
  END LOOP;
  UPDATE memories SET fence_counter = v_token WHERE memory_id = p_memory;
  INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version,
                          icu_version, first_claimed_at, last_claimed_at)
  VALUES (p_name, p_display, p_skeleton, p_tenant, p_unicode, p_icu, v_now, v_now)
  ON CONFLICT (canonical_name) DO UPDATE
    SET display_name = excluded.display_name, skeleton = excluded.skeleton,
        tenant_id = excluded.tenant_id, unicode_version = excluded.unicode_version,
        icu_version = excluded.icu_version, last_claimed_at = excluded.last_claimed_at;
  FOR v_e IN SELECT * FROM jsonb_array_elements(v_expired) LOOP
    PERFORM mep_audit(p_tenant, 'LEASE_TAKEOVER', v_e->>'n', v_e->>'m', (v_e->>'t')::bigint, v_now);
  END LOOP;
  PERFORM mep_audit(p_tenant, 'LEASE_ACQUIRED', p_name, p_memory, v_token, v_now);
  status := 201;
  result := jsonb_build_object('lease_id', v_lease_id, 'canonical_name', p_name,
              'display_name', p_display, 'memory_instance_id', p_memory, 'fencing_token', v_token,
              'expires_at', v_now + p_ttl * 1000, 'ttl_seconds', p_ttl, 'server_time', v_now,
              'outcome', CASE WHEN v_reclaim_id IS NOT NULL THEN 'reclaimed' ELSE 'granted' END);
  PERFORM mep_idem_end(p_tenant, p_key, status, result);
END
$$;

-- Renews one lease: the expiry becomes max(old, now + ttl), never shorter.
CREATE OR REPLACE FUNCTION mep_renew_one(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_ttl bigint, p_now bigint, p_request_id text) RETURNS jsonb
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
     AND canonical_name = p_name AND owner_client_id = p_owner AND expires_at > p_now
  RETURNING expires_at INTO v_exp;
  IF FOUND THEN
    RETURN jsonb_build_object('expires_at', v_exp, 'ttl_seconds', p_ttl, 'server_time', p_now);
  END IF;
  v_problem := mep_classify(p_tenant, p_memory, p_token, p_now, 'lease-not-found', p_request_id);
  IF v_problem IS NOT NULL THEN
    RETURN v_problem;
  END IF;
  RETURN mep_problem('lease-not-found', 'no lease of this owner under this name', p_request_id);
END
$$;

CREATE OR REPLACE FUNCTION mep_renew(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_ttl bigint, p_request_id text) RETURNS jsonb LANGUAGE sql AS $$
  SELECT mep_renew_one(p_tenant, p_name, p_memory, p_token, p_owner, p_ttl, mep_now_ms(), p_request_id)
$$;

-- Renews many leases in one transaction; the results are in the order of the arrays.
CREATE OR REPLACE FUNCTION mep_renew_batch(p_tenant text, p_names text[], p_memories text[],
    p_tokens bigint[], p_owners text[], p_ttls bigint[], p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_out jsonb;
BEGIN
  SELECT coalesce(jsonb_agg(mep_renew_one(p_tenant, p_names[i], p_memories[i], p_tokens[i],
                                          p_owners[i], p_ttls[i], v_now, p_request_id) ORDER BY i),
                  '[]'::jsonb)
    INTO v_out
    FROM generate_series(1, coalesce(array_length(p_names, 1), 0)) AS i;
  RETURN v_out;
END
$$;

-- Release: 204 also when the grant already ended (idempotent); an expired row goes now.
CREATE OR REPLACE FUNCTION mep_release(p_tenant text, p_name text, p_memory text, p_token bigint,
    p_owner text, p_request_id text) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_row record;
  v_problem jsonb;
BEGIN
  DELETE FROM leases
   WHERE memory_id = p_memory AND fencing_token = p_token AND tenant_id = p_tenant
     AND canonical_name = p_name AND owner_client_id = p_owner AND expires_at > v_now
  RETURNING tenant_id, canonical_name, memory_id, fencing_token INTO v_row;
  IF FOUND THEN
    PERFORM mep_audit(p_tenant, 'LEASE_RELEASED', v_row.canonical_name, v_row.memory_id,
                      v_row.fencing_token, v_now);
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
  RETURNING tenant_id, canonical_name, memory_id, fencing_token INTO v_row;
  IF FOUND THEN
    PERFORM mep_audit(v_row.tenant_id, 'LEASE_EXPIRED', v_row.canonical_name, v_row.memory_id,
                      v_row.fencing_token, v_now);
  END IF;
  RETURN '{"outcome": "released"}'::jsonb;
END
$$;

CREATE OR REPLACE FUNCTION mep_verify(p_tenant text, p_memory text, p_token bigint, p_request_id text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_problem jsonb;
  v_row record;
BEGIN
  v_problem := mep_classify(p_tenant, p_memory, p_token, v_now, 'memory-not-found', p_request_id);
  IF v_problem IS NOT NULL THEN
    RETURN v_problem;
  END IF;
  SELECT canonical_name, fencing_token, expires_at INTO v_row FROM leases WHERE memory_id = p_memory;
  RETURN jsonb_build_object('memory_instance_id', p_memory, 'fencing_token', v_row.fencing_token,
                            'canonical_name', v_row.canonical_name, 'expires_at', v_row.expires_at,
                            'server_time', v_now);
END
$$;

CREATE OR REPLACE FUNCTION mep_register(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_memory text, OUT status integer, OUT result jsonb, OUT replayed boolean)
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_hit record;
  v_mem record;
BEGIN
  SELECT * INTO v_hit FROM mep_idem_begin(p_tenant, p_key, p_fp, v_now, p_request_id);
  IF v_hit.hit THEN
    status := v_hit.status; result := v_hit.result; replayed := v_hit.replayed;
    RETURN;
  END IF;
  replayed := false;
  INSERT INTO memories(memory_id, tenant_id, fence_counter, created_at)
  VALUES (p_memory, p_tenant, 0, v_now) ON CONFLICT (memory_id) DO NOTHING;
  IF FOUND THEN
    PERFORM mep_audit(p_tenant, 'MEMORY_REGISTERED', NULL, p_memory, NULL, v_now);
    status := 201;
    result := jsonb_build_object('memory_instance_id', p_memory, 'created_at', v_now);
  ELSE
    SELECT tenant_id, created_at INTO v_mem FROM memories WHERE memory_id = p_memory;
    IF v_mem.tenant_id <> p_tenant THEN
      status := 409;
      result := mep_problem('memory-id-taken', 'this memory id is taken', p_request_id);
    ELSE
      status := 200;
      result := jsonb_build_object('memory_instance_id', p_memory, 'created_at', v_mem.created_at);
    END IF;
  END IF;
  PERFORM mep_idem_end(p_tenant, p_key, status, result);
END
$$;

CREATE OR REPLACE FUNCTION mep_branch(p_tenant text, p_key text, p_fp text, p_request_id text,
    p_parent text, p_token bigint, p_memory text, OUT status integer, OUT result jsonb,
    OUT replayed boolean)
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_hit record;
BEGIN
  SELECT * INTO v_hit FROM mep_idem_begin(p_tenant, p_key, p_fp, v_now, p_request_id);
  IF v_hit.hit THEN
    status := v_hit.status; result := v_hit.result; replayed := v_hit.replayed;
    RETURN;
  END IF;
  replayed := false;
  result := mep_classify(p_tenant, p_parent, p_token, v_now, 'memory-not-found', p_request_id);
  IF result IS NOT NULL THEN
    status := 400;
  ELSE
    INSERT INTO memories(memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at)
    VALUES (p_memory, p_tenant, p_parent, p_token, 0, v_now) ON CONFLICT (memory_id) DO NOTHING;
    IF FOUND THEN
      PERFORM mep_audit(p_tenant, 'MEMORY_BRANCHED', NULL, p_memory, p_token, v_now);
      status := 201;
      result := jsonb_build_object('memory_instance_id', p_memory, 'parent_memory_instance_id', p_parent,
                                   'branched_at_token', p_token, 'outcome', 'branched');
    ELSE
      status := 409;
      result := mep_problem('memory-id-taken', 'this memory id is taken', p_request_id);
    END IF;
  END IF;
  PERFORM mep_idem_end(p_tenant, p_key, status, result);
END
$$;

CREATE OR REPLACE FUNCTION mep_revoke(p_tenant text, p_name text, p_request_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_row record;
BEGIN
  DELETE FROM leases WHERE canonical_name = p_name AND tenant_id = p_tenant AND expires_at > v_now
  RETURNING canonical_name, memory_id, fencing_token INTO v_row;
  IF NOT FOUND THEN
    RETURN mep_problem('lease-not-found', 'no live lease under this name', p_request_id);
  END IF;
  PERFORM mep_audit(p_tenant, 'LEASE_REVOKED', v_row.canonical_name, v_row.memory_id,
                    v_row.fencing_token, v_now);
  RETURN '{"outcome": "revoked"}'::jsonb;
END
$$;

-- Removes expired leases (auditing each) and idempotency records, a bounded number per
-- call; rows another transaction holds are left for the next call (several servers sweep).
CREATE OR REPLACE FUNCTION mep_sweep() RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint := mep_now_ms();
  v_row record;
  v_n bigint := 0;
  v_c bigint;
BEGIN
  FOR v_row IN DELETE FROM leases WHERE lease_id IN
                 (SELECT lease_id FROM leases WHERE expires_at <= v_now LIMIT 1000 FOR UPDATE SKIP LOCKED)
                 AND expires_at <= v_now
               RETURNING tenant_id, canonical_name, memory_id, fencing_token LOOP
    PERFORM mep_audit(v_row.tenant_id, 'LEASE_EXPIRED', v_row.canonical_name, v_row.memory_id,
                      v_row.fencing_token, v_now);
    v_n := v_n + 1;
  END LOOP;
  DELETE FROM idempotency WHERE (tenant_id, idem_key) IN
    (SELECT tenant_id, idem_key FROM idempotency WHERE expires_at <= v_now LIMIT 5000 FOR UPDATE SKIP LOCKED)
    AND expires_at <= v_now;
  GET DIAGNOSTICS v_c = ROW_COUNT;
  RETURN v_n + v_c;
END
$$;
)sql";

} // namespace mep::server
