-- Version 3: branching. mep_branch (created here, not in version 1) answers 200 to the same
-- branch made again with the client's memory id (own tenant, same parent and token).
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
