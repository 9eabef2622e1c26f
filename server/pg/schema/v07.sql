-- Version 7: a claim costs PostgreSQL half the CPU (issue 22). What v6's claim spent its
-- time on, by pg_stat_statements: HMAC-SHA256 and UUIDv7 computed in PL/pgSQL for every
-- audit row, an idempotency row inserted first and updated at the end, a takeover DELETE
-- and two audit inserts run on every claim with nothing to take over, three lookups of the
-- same one to three lease rows, and a re-claim that deleted and re-inserted its own row.
-- * The server computes the audit hashes and the event id of a claim (it caches each
--   tenant's salt) and passes them in (p_event, p_name_hash, p_memory_hash). A lease row
--   keeps the hashes of its name and memory (name_hash, memory_hash), so the audit rows of
--   its expiry, takeover and release copy them instead of hashing again. Rows without them
--   (granted before v7, or by a server of an earlier version) are hashed in SQL as before.
-- * The Idempotency-Key is looked up first and written once, with the outcome, at the end
--   (mep_idem_put). A concurrent duplicate that committed in between makes that insert find
--   the key taken: the call rolls back (40001), the server runs it again, and it replays
--   the stored outcome. So still one outcome per key, and no effect from a duplicate.
-- * One SELECT of the rows that share the name, the skeleton or the memory answers what the
--   three lookups answered; the takeover DELETE runs only when one of them has expired.
-- * A re-claim updates its own row in place (the memory's lock keeps other claims out; a
--   concurrent release of the row makes the update find nothing, and the loop looks again).
-- The v6 signatures stay, for servers of an earlier version during a rolling upgrade.
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
