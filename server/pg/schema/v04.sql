-- v4: a revocation says which memory it freed, and tells every server (LISTEN
-- mep_lease_freed) the name and the memory itself, in its transaction and only when it
-- revoked something: claims waiting for that memory under another name wake too.
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
