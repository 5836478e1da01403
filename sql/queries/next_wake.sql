-- When a run of scope ($1, $2) next becomes claimable by the clock alone, after $3 (see
-- ledger.next_wake): each part is the first ahead in its index.
SELECT least(
    -- A wait's or a backoff's wake time (infinity: only an input wakes it).
    (SELECT not_before FROM ledger.runs
      WHERE tenant_id = $1 AND workspace_id = $2 AND not_before > $3 AND not_before < 'infinity'
        AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
      ORDER BY not_before LIMIT 1),
    -- A pending approval's deadline: past it, the run's next claim is told.
    (SELECT expires_at FROM ledger.approval_requests
      WHERE tenant_id = $1 AND workspace_id = $2 AND status = 'pending' AND expires_at > $3
      ORDER BY expires_at LIMIT 1),
    -- The end of a full rate window.
    (SELECT min(window_start + make_interval(secs => window_seconds)) FROM ledger.concurrency_limits
      WHERE tenant_id = $1 AND workspace_id = $2 AND max_per_window <= window_claims
        AND window_start + make_interval(secs => window_seconds) > $3))
