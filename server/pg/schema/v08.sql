-- Version 8: renewals (and fence verifications) carry the clock's bound, as claims and
-- sweeps have since v6. A forward
-- step of the database clock made every lease whose expiry it jumped over look expired to a
-- renewal until a server found the step and recorded it (up to a second later): the holder
-- was told 410 lease-expired and gave its lease up, though no claim could have taken it (a
-- claim's bound still held it). Now a renewal decides liveness at least(now, bound), as a
-- claim does, and the new expiry is still max(old, now + ttl). The v1 signatures stay, as
-- wrappers without a bound, for servers of an earlier version during a rolling upgrade.
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
