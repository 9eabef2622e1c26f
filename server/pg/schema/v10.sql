-- Version 10: claims in batches. A server sends the claims queued while its earlier batches
-- run in one call, one transaction and one commit; it keeps few of them in flight at once
-- (PgStore::m_claim_lanes), so that a database on few cores is not shared by many backends
-- each running one claim, which cost each claim more (see PgStore).
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
