-- The charge summary of a trace spec: entries counted, amounts summed as numeric per currency.
SELECT jsonb_build_object(
           'entry_count', coalesce(sum(n), 0),
           'amounts', coalesce(jsonb_object_agg(currency, total::text)
                                   FILTER (WHERE currency IS NOT NULL), '{}'::jsonb))
  FROM (SELECT x.currency, count(*) AS n, sum(x.amount) AS total
          FROM ledger.run_cost_entries x
         WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.run_id = $3
           AND x.amount IS NOT NULL
         GROUP BY x.currency) c
