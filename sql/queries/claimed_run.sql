-- The claimed run $3 as ledger.claimed_run: $4 takeover, $5 the previous owner, $6 its inputs.
-- Steps in creation order, tool calls and pending approvals oldest first, and the id of the
-- feed's newest event (the follower's cursor).
SELECT ROW(r.tenant_id, r.workspace_id, r.id, r.run_token, r.lease_owner, r.lease_expires_at,
           $4::boolean, $5::text, r.status, r.mode, r.kind, r.attempt_no, r.source_run_id, $6::jsonb,
           (SELECT coalesce(jsonb_agg(jsonb_build_object('id', s.id, 'step_key', s.step_key,
                                                         'step_type', s.step_type, 'status', s.status)
                                      ORDER BY s.step_no), '[]')
              FROM ledger.run_steps s
             WHERE s.tenant_id = r.tenant_id AND s.workspace_id = r.workspace_id AND s.run_id = r.id),
           (SELECT coalesce(jsonb_agg(jsonb_build_object('id', t.id, 'tool_call_id', t.tool_call_id,
                                                         'idempotency_key', t.idempotency_key,
                                                         'tool_ref', t.tool_ref, 'status', t.status,
                                                         'attempt', t.attempt)
                                      ORDER BY t.created_at, t.id), '[]')
              FROM ledger.run_step_tool_calls t
             WHERE t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id AND t.run_id = r.id),
           (SELECT coalesce(jsonb_agg(jsonb_build_object('id', a.id, 'tool_call_record_id', a.tool_call_record_id,
                                                         'step_id', a.step_id)
                                      ORDER BY a.created_at, a.id), '[]')
              FROM ledger.approval_requests a
             WHERE a.tenant_id = r.tenant_id AND a.workspace_id = r.workspace_id AND a.run_id = r.id
               AND a.status = 'pending' AND (a.expires_at IS NULL OR a.expires_at > clock_timestamp())),
           (SELECT e.id FROM ledger.run_events e
             WHERE e.tenant_id = r.tenant_id AND e.workspace_id = r.workspace_id AND e.run_id = r.id
               AND e.seq = r.last_seq))::ledger.claimed_run
  FROM ledger.runs r
 WHERE r.tenant_id = $1 AND r.workspace_id = $2 AND r.id = $3
