-- Version 12: operating a fleet of leases (issue 54). A lease row says who holds it (holder:
-- the JSON a daemon sent, never a path), since when its owner holds it (granted_at: a
-- re-claim keeps it), its renewals and when they stop (hold_until, from max_hold_seconds or
-- the server's --max-hold). A refusal because a name or memory is held names the holder to a
-- requester of its tenant (mep_holder_view). A revocation is remembered on the memory
-- (revoked_token, revoke_reason), so that its holder's next renewal learns why its lease
-- ended. The audit row that ends a lease carries its renewals. Functions whose signature
-- stays are replaced in place (their answers only gain members); the claim is mep_claim_h,
-- with the holder and the hold as new parameters, beside v9's mep_claim_t for servers of an
-- earlier version during a rolling upgrade.
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
