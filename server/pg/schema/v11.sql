-- Version 11: renewals in one UPDATE. v8's mep_renew_batch called mep_renew_one, a function
-- and a statement, for each lease: most of a batch's database CPU went to setting up those
-- statements, not to the rows. mep_renew_many takes the renewals of several requests (a
-- server sends the single renewals queued together in one call, as it does claims), and
-- mep_release_many the releases.
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
