-- Version 6: wall-clock steps of the database's clock (SPEC §9, issue 21). This backend's
-- lease clock is the database's wall clock, which an NTP step moves. Each server reads it
-- every second against its own monotonic clock (PgStore's ClockWatch):
-- * a claim carries the latest time the database clock can honestly read (p_bound: the
--   server's last reading advanced by its monotonic clock, plus a tolerance), and decides
--   expiry for takeovers at the lesser of the two, so a forward step is harmless from the
--   instant it happens;
-- * the server that finds a forward step records it in mep_clock_steps, and a lease that
--   expired inside a recorded step is held back from takeovers for one TTL after the step
--   (Chubby's lock-delay) while its holder can still renew it. A backward step only makes
--   leases outlive their TTL by its size; it is counted and logged.
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
