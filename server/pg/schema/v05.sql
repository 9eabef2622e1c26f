-- v5: one queue of waiting claims for all the servers on the database (Prefer: wait).
-- A waiting claim takes a ticket, a row of mep_waiters, when it starts to wait; tickets
-- are in order of arrival. A claim is refused (423) while an earlier ticket, or for a
-- claim that does not wait any ticket, waits for its skeleton or memory (in mep_claim).
-- A ticket counts while its server keeps it alive (alive_until, renewed every second), so
-- the tickets of a server that died hold no one up for more than a few seconds. The claim
-- functions of v1 and v4 take the ticket as a new last parameter; their old forms stay, as
-- claims without a ticket, for earlier servers that run on during a rolling upgrade.
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
