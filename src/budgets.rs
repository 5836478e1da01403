//! Budgets: what the runs of a tenant, of a workspace or one run may spend in a window
//! (`ledger.budgets`, read through `ledger.budget_usage`). Spending is counted where it happens:
//! `record_cost` adds money and tokens (and never refuses a cost: it was incurred), the tool-call
//! claims add the executions they hand out, `create_step` the `llm` steps it creates. A decision
//! to spend is refused (`budget_exhausted`, returned, not raised) while a budget that applies is
//! used up, and the run parks for a person. A metered budget's rows are locked by the decision
//! that counts on them, so no two decisions can both take the last unit.

use crate::audit;
use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::notifier;
use crate::outbox;
use crate::redaction::free_text;
use crate::rows::{self, LockedRun};
use crate::runs::{self, RunEnd};
use crate::scope::{self, Scope};
use ledger_model::args::{optional_id, optional_label, required};
use ledger_model::budgets::{self, Level, Meter};
use ledger_model::events::{AuditKind, BudgetEvent, Event};
use ledger_model::evidence::costs;
use ledger_model::status::Status;
use pgrx::prelude::*;
use pgrx::AnyNumeric;
use serde_json::json;

/// What a claim of runs adds to its candidates (alias `r`, the scope in `$1` and `$2`): no
/// budget that applies to the run is used up.
pub const WITHIN_BUDGET: &str = "NOT EXISTS (SELECT 1 FROM ledger.budgets b \
     WHERE b.tenant_id = $1 AND (b.workspace_id IS NULL OR b.workspace_id = $2) \
       AND (b.run_id IS NULL OR b.run_id = r.id) \
       AND b.max_amount <= ledger.budget_spent(b.period, b.spent, b.window_start, now()))";

/// The error code of a run parked, or an `llm` step refused, by a budget.
pub const EXHAUSTED: &str = "BUDGET_EXHAUSTED";

/// The budgets that apply to run `$3` of the scope (`$1`, `$2`): its own, its workspace's and
/// its tenant's.
const APPLIES: &str = "b.tenant_id = $1 AND (b.workspace_id IS NULL OR b.workspace_id = $2) \
     AND (b.run_id IS NULL OR b.run_id = $3)";

/// A `ledger.budget_usage` row `u` as answers and events show it (amounts as decimal strings).
const BUDGET_JSON: &str = "jsonb_build_object('level', u.level, 'run_id', u.run_id, \
     'unit', u.unit, 'period', u.period, 'max_amount', u.max_amount::text, \
     'spent', u.spent::text, 'remaining', u.remaining::text, \
     'window_start', u.window_start, 'window_end', u.window_end)";

/// The budgets that apply to run `$3` as a JSON array (text) of `BUDGET_JSON` with `exhausted` and
/// `warned`: the evidence bundle's `budgets`.
pub fn applying_json() -> String {
    format!(
        "SELECT coalesce(json_agg({BUDGET_JSON} || jsonb_build_object('exhausted', u.exhausted, \
                 'warned', u.warned) ORDER BY u.run_id NULLS LAST, u.workspace_id NULLS LAST, \
                 u.unit, u.period), '[]')::text \
           FROM ledger.budget_usage u \
          WHERE u.tenant_id = $1 AND (u.workspace_id IS NULL OR u.workspace_id = $2) \
            AND (u.run_id IS NULL OR u.run_id = $3)"
    )
}

/// The first used-up budget that applies to run `$3`, as `BUDGET_JSON`, and how many budgets of
/// unit `$4` apply.
fn check_query() -> String {
    format!(
        "SELECT (SELECT {BUDGET_JSON} FROM ledger.budget_usage u \
                  WHERE u.tenant_id = $1 AND (u.workspace_id IS NULL OR u.workspace_id = $2) \
                    AND (u.run_id IS NULL OR u.run_id = $3) AND u.exhausted \
                  ORDER BY u.run_id NULLS LAST, u.workspace_id NULLS LAST, u.unit, u.period LIMIT 1), \
                (SELECT count(*) FROM ledger.budgets b WHERE {APPLIES} AND b.unit = $4)"
    )
}

/// Decides whether run `run` may spend one unit of `meter` (an execution, an `llm` step): None
/// when it may, counted against the meter's budgets; else the used-up budget (as `BUDGET_JSON`).
/// One statement when no budget of the meter applies.
pub fn decide(scope: &Scope, run: &LockedRun, meter: Meter) -> Result<Option<Jsonb>> {
    let check = |r: &db::Row| Ok((db::opt::<Jsonb>(r, 1)?, db::req::<i64>(r, 2)?));
    let args = scope.args([run.id.as_str().into(), meter.as_str().into()]);
    let (used_up, metered) = db::select_one(&check_query(), &args, check)?.unwrap_or((None, 0));
    if used_up.is_some() || metered == 0 {
        return Ok(used_up);
    }
    // The meter's budgets are locked (in REPEATABLE READ, one counted since the snapshot fails
    // 40001), then read again as they are now: no two decisions both take the last unit.
    db::write_one(
        &format!("SELECT count(*) FROM (SELECT 1 FROM ledger.budgets b WHERE {APPLIES} AND b.unit = $4 FOR NO KEY UPDATE) l"),
        &args,
        |r| db::req::<i64>(r, 1),
    )?;
    let (used_up, _) = db::select_one(&check_query(), &args, check)?.unwrap_or((None, 0));
    if used_up.is_none() {
        spend(scope, &run.id, &[(meter.as_str(), "1".to_owned())])?;
    }
    Ok(used_up)
}

/// Adds `amounts` (unit, decimal text) to the budgets of those units that apply to run
/// `run_id`, starting a budget's window over when it has passed, and writes each budget's
/// warning the first time in its window that it reaches its share.
pub fn spend(scope: &Scope, run_id: &str, amounts: &[(&str, String)]) -> Result<()> {
    if amounts.is_empty() {
        return Ok(());
    }
    let units: Vec<&str> = amounts.iter().map(|(unit, _)| *unit).collect();
    let values: Vec<&str> = amounts.iter().map(|(_, amount)| amount.as_str()).collect();
    let now = db::now()?;
    let warn = db::write_one(
        &format!(
            "WITH s AS (UPDATE ledger.budgets b \
                SET spent = ledger.budget_spent(b.period, b.spent, b.window_start, $6) + a.amount::numeric, \
                    window_start = ledger.budget_window(b.period, $6), updated_at = $6 \
               FROM unnest($4::text[], $5::text[]) AS a (unit, amount) \
              WHERE {APPLIES} AND b.unit = a.unit \
          RETURNING b.warn_ratio IS NOT NULL AND b.spent >= b.max_amount * b.warn_ratio \
                    AND b.warned_window IS DISTINCT FROM b.window_start AS warn) \
             SELECT coalesce(bool_or(warn), false) FROM s"
        ),
        &scope.args([run_id.into(), units.clone().into(), values.into(), now.into()]),
        |r| db::req::<bool>(r, 1),
    )?;
    if warn != Some(true) {
        return Ok(());
    }
    // The rows are this transaction's now, so each warning is written once per window.
    let warned = db::select(
        &format!(
            "WITH w AS (UPDATE ledger.budgets b SET warned_window = b.window_start \
                 WHERE {APPLIES} AND b.unit = ANY ($4) AND b.warn_ratio IS NOT NULL \
                   AND b.window_start = ledger.budget_window(b.period, $5) \
                   AND b.spent >= b.max_amount * b.warn_ratio \
                   AND b.warned_window IS DISTINCT FROM b.window_start \
             RETURNING b.tenant_id, b.workspace_id, b.run_id, b.unit, b.period) \
             SELECT {BUDGET_JSON} FROM ledger.budget_usage u JOIN w \
                 ON w.tenant_id = u.tenant_id AND w.workspace_id IS NOT DISTINCT FROM u.workspace_id \
                AND w.run_id IS NOT DISTINCT FROM u.run_id AND w.unit = u.unit AND w.period = u.period"
        ),
        &scope.args([run_id.into(), units.into(), now.into()]),
        |r| db::req::<Jsonb>(r, 1),
    )?;
    let run = rows::lock_run(scope, "run_id", run_id)?;
    for budget in warned {
        announce(scope, &run, None, None, &budget, false)?;
    }
    Ok(())
}

/// What `record_cost` spends: its amount in its currency, and the tokens of its usage.
pub fn cost_amounts<'a>(
    amount: Option<&AnyNumeric>,
    currency: Option<&'a str>,
    usage: &serde_json::Value,
) -> Vec<(&'a str, String)> {
    let mut spent = Vec::new();
    if let (Some(amount), Some(currency)) = (amount, currency) {
        spent.push((currency, amount.to_string()));
    }
    let tokens = budgets::tokens_of(usage);
    if tokens > 0 {
        spent.push((Meter::Tokens.as_str(), tokens.to_string()));
    }
    spent
}

/// Writes a budget's event to the run's feed and the outbox: `budget.exhausted` for a refused
/// decision (`decision`, `subject`), else `budget.warning`.
fn announce(
    scope: &Scope,
    run: &LockedRun,
    decision: Option<&str>,
    subject: Option<&str>,
    budget: &Jsonb,
    refused: bool,
) -> Result<()> {
    let budget = budget.value()?;
    let payload = BudgetEvent {
        run_id: &run.id,
        decision,
        subject,
        budget: &budget,
    };
    let event = if refused {
        Event::BudgetExhausted(payload)
    } else {
        Event::BudgetWarning(payload)
    };
    feed::append(scope, run.held(), None, &event)?;
    outbox::enqueue(
        scope,
        &event,
        Some(&run.id),
        None,
        &format!("run:{}", run.id),
    )?;
    Ok(())
}

/// What follows a refused decision: `budget.exhausted` to the run's feed and the outbox, and the
/// run parked (`paused`, error_code `BUDGET_EXHAUSTED`) where its status allows, for a person
/// who raises the budget or ends the run. `claim_run` hands it out again once no budget that
/// applies is used up.
pub fn park(
    scope: &Scope,
    run: &LockedRun,
    decision: &str,
    subject: Option<&str>,
    budget: &Jsonb,
) -> Result<()> {
    announce(scope, run, Some(decision), subject, budget, true)?;
    // The status as it is now: an earlier refusal in this statement may have parked it.
    let status = db::select_one(
        "SELECT status FROM ledger.runs WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([run.id.as_str().into()]),
        |r| db::req::<String>(r, 1),
    )?
    .and_then(|s| Status::from_name(&s));
    match status {
        Some(from) if from.moves_to().contains(&Status::Paused) => runs::move_run(
            scope,
            run,
            from,
            Status::Paused,
            RunEnd {
                error_code: Some(EXHAUSTED),
                error_message: Some("a budget that applies to the run is used up"),
                ..RunEnd::default()
            },
        ),
        _ => Ok(()),
    }
}

/// Sets a budget of the tenant, the scope's workspace or one of its runs (NULL `max_amount`
/// removes it), audited with `actor` and `note`; returns it as `ledger.budget_usage` shows it.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_views"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn set_budget(
    unit: Option<&str>,
    max_amount: Option<AnyNumeric>,
    level: default!(Option<&str>, "'workspace'"),
    run_id: default!(Option<&str>, "NULL"),
    period: default!(Option<&str>, "'total'"),
    warn_ratio: default!(Option<AnyNumeric>, "0.8"),
    actor: default!(Option<&str>, "NULL"),
    note: default!(Option<&str>, "NULL"),
) -> std::result::Result<
    SetOfIterator<'static, pgrx::composite_type!('static, "ledger.budget_usage")>,
    SqlError,
> {
    Ok(SetOfIterator::new(set(
        unit, max_amount, level, run_id, period, warn_ratio, actor, note,
    )?))
}

#[allow(clippy::too_many_arguments)]
fn set(
    unit: Option<&str>,
    max_amount: Option<AnyNumeric>,
    level: Option<&str>,
    run_id: Option<&str>,
    period: Option<&str>,
    warn_ratio: Option<AnyNumeric>,
    actor: Option<&str>,
    note: Option<&str>,
) -> Result<Option<pgrx::composite_type!('static, "ledger.budget_usage")>> {
    let scope = scope::current()?;
    // A raised budget lets the runs it stopped go on (nothing is sent if this fails).
    notifier::runs_ready();
    let unit = budgets::unit(required("unit", unit)?)?;
    let level = Level::parse(required("level", level)?)?;
    let period = budgets::period(required("period", period)?)?;
    let run_id = optional_id("run_id", run_id)?;
    let actor = free_text(optional_label("actor", actor)?);
    if let Some(max) = &max_amount {
        costs::check_non_negative("max_amount", Code::AmountInvalid, &max.to_string())?;
    }
    if let Some(ratio) = &warn_ratio {
        budgets::warn_ratio(&ratio.to_string())?;
    }
    let workspace = match (level, run_id) {
        (Level::Run, None) => return Err(LedgerError::required("run_id")),
        (Level::Run, Some(id)) => {
            rows::run(&scope, "run_id", id)?;
            Some(scope.workspace.as_str())
        }
        (_, Some(_)) => {
            return Err(LedgerError::new(
                Code::ArgumentConflict,
                "run_id is for a run's budget (level run)",
            )
            .with("argument", "run_id"))
        }
        (Level::Workspace, None) => Some(scope.workspace.as_str()),
        (Level::Tenant, None) => {
            tenant_granted(&scope)?;
            None
        }
    };
    let key = || -> Vec<pgrx::datum::DatumWithOid> {
        vec![
            scope.tenant.as_str().into(),
            workspace.into(),
            run_id.into(),
            unit.as_str().into(),
            period.into(),
        ]
    };
    let before = db::select_one(
        &format!(
            "SELECT {BUDGET_JSON} FROM ledger.budget_usage u \
              WHERE u.tenant_id = $1 AND u.workspace_id IS NOT DISTINCT FROM $2 \
                AND u.run_id IS NOT DISTINCT FROM $3 AND u.unit = $4 AND u.period = $5"
        ),
        &key(),
        |r| db::req::<Jsonb>(r, 1),
    )?;
    match &max_amount {
        None => db::execute(
            "DELETE FROM ledger.budgets b WHERE b.tenant_id = $1 AND b.workspace_id IS NOT DISTINCT FROM $2 \
                AND b.run_id IS NOT DISTINCT FROM $3 AND b.unit = $4 AND b.period = $5",
            &key(),
        )?,
        Some(max) => {
            let mut upsert = key();
            upsert.extend([
                max.clone().into(),
                warn_ratio.clone().into(),
                actor.clone().into(),
                db::now()?.into(),
            ]);
            db::execute(
                "INSERT INTO ledger.budgets AS b (tenant_id, workspace_id, run_id, unit, period, \
                        max_amount, warn_ratio, updated_by) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                 ON CONFLICT (tenant_id, workspace_id, run_id, unit, period) DO UPDATE \
                    SET max_amount = EXCLUDED.max_amount, warn_ratio = EXCLUDED.warn_ratio, \
                        updated_by = EXCLUDED.updated_by, updated_at = $9, \
                        warned_window = CASE WHEN EXCLUDED.max_amount > b.max_amount \
                                             THEN NULL ELSE b.warned_window END",
                &upsert,
            )?;
        }
    }
    let after = db::select_one(
        &format!(
            "SELECT {BUDGET_JSON} FROM ledger.budget_usage u \
              WHERE u.tenant_id = $1 AND u.workspace_id IS NOT DISTINCT FROM $2 \
                AND u.run_id IS NOT DISTINCT FROM $3 AND u.unit = $4 AND u.period = $5"
        ),
        &key(),
        |r| db::req::<Jsonb>(r, 1),
    )?;
    audit::write(
        &scope,
        run_id,
        None,
        AuditKind::BudgetSet,
        if max_amount.is_some() {
            "set"
        } else {
            "removed"
        },
        actor.as_deref(),
        json!({
            "before": before.map(|b| b.value()).transpose()?,
            "after": after.map(|a| a.value()).transpose()?,
            "note": free_text(note),
        }),
    )?;
    db::select_one(
        "SELECT u FROM ledger.budget_usage u \
          WHERE u.tenant_id = $1 AND u.workspace_id IS NOT DISTINCT FROM $2 \
            AND u.run_id IS NOT DISTINCT FROM $3 AND u.unit = $4 AND u.period = $5",
        &key(),
        |r| db::req(r, 1),
    )
}

/// A tenant's budget limits every workspace of it: a login role bound to some of its workspaces
/// may not set one (42501 `TENANT_NOT_GRANTED`).
fn tenant_granted(scope: &Scope) -> Result<()> {
    let granted = db::select_one(
        "SELECT ledger_dispatch.tenant_granted($1)",
        &[scope.tenant.as_str().into()],
        |r| db::req::<bool>(r, 1),
    )?;
    if granted == Some(true) {
        return Ok(());
    }
    Err(LedgerError::new(
        Code::TenantNotGranted,
        "a tenant's budget needs a grant of every workspace of the tenant",
    )
    .with("tenant_id", scope.tenant.as_str()))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, running_run, set_scope};
    use pgrx::prelude::*;

    fn claim(call: &str) -> String {
        one::<String>(&format!(
            "SELECT ledger.claim_tool_call('r', 'mail.send', '{{}}', tool_call_id => '{call}')::text"
        ))
    }

    fn outcome(call: &str) -> String {
        let answer: serde_json::Value = serde_json::from_str(&claim(call)).unwrap();
        answer["outcome"].as_str().unwrap().to_owned()
    }

    fn events(kind: &str) -> i64 {
        one::<i64>(&format!(
            "SELECT (SELECT count(*) FROM ledger.run_events WHERE event_type = '{kind}') \
                  + (SELECT count(*) FROM ledger.outbox WHERE event_type = '{kind}')"
        ))
    }

    /// A run's budget of tool calls hands out exactly its executions; the next claim answers
    /// budget_exhausted (nothing created, the run parked, the stop announced), replays are not
    /// decisions, and a person's raise (audited) lets the run go on.
    #[pg_test]
    fn a_used_up_budget_refuses_the_next_execution_and_parks_the_run() {
        running_run("t-budget-calls");
        assert_eq!(
            one::<String>(
                "SELECT concat_ws('|', level, run_id, unit, period, max_amount, spent, remaining, exhausted) \
                   FROM ledger.set_budget('tool_calls', 2, 'run', run_id => 'r')"
            ),
            "run|r|tool_calls|total|2|0|2|f"
        );
        assert_eq!(outcome("a"), "claimed");
        Spi::run(
            "SELECT ledger.complete_tool_call(id, attempt, 'succeeded', '{}') \
               FROM ledger.run_step_tool_calls WHERE tool_call_id = 'a'",
        )
        .unwrap();
        assert_eq!(outcome("b"), "claimed");
        let refused: serde_json::Value = serde_json::from_str(&claim("c")).unwrap();
        assert_eq!(refused["outcome"], "budget_exhausted");
        assert_eq!(refused["tool_call"], serde_json::Value::Null);
        assert_eq!(
            (
                &refused["budget"]["level"],
                &refused["budget"]["unit"],
                &refused["budget"]["max_amount"],
                &refused["budget"]["spent"]
            ),
            (
                &serde_json::json!("run"),
                &serde_json::json!("tool_calls"),
                &serde_json::json!("2"),
                &serde_json::json!("2")
            )
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            2
        );
        assert_eq!(
            one::<String>("SELECT status || ':' || error_code FROM ledger.runs WHERE id = 'r'"),
            "paused:BUDGET_EXHAUSTED"
        );
        assert_eq!(events("budget.exhausted"), 2, "the feed and the outbox");
        assert_eq!(
            one::<String>(
                "SELECT payload->>'decision' || ':' || (payload->>'subject') FROM ledger.run_events \
                  WHERE event_type = 'budget.exhausted'"
            ),
            "tool_call:c"
        );
        // A finished call replays: no decision to spend.
        assert_eq!(outcome("a"), "replayed");
        // A person raises the budget; the refused call is claimed.
        assert_eq!(
            one::<String>(
                "SELECT remaining::text FROM ledger.set_budget('tool_calls', 3, 'run', run_id => 'r', \
                        actor => 'alice', note => 'one more, token sk-live-0123456789abcdefghij')"
            ),
            "1"
        );
        assert_eq!(
            one::<String>(
                "SELECT concat_ws('|', outcome, actor, payload->'before'->>'max_amount', payload->'after'->>'max_amount', payload->>'note') \
                   FROM ledger.audit_events WHERE gateway_type = 'budget.set' ORDER BY created_at DESC, id DESC LIMIT 1"
            ),
            "set|alice|2|3|one more, token [REDACTED]"
        );
        Spi::run("SELECT ledger.transition_run('r', 'running')").unwrap();
        assert_eq!(outcome("c"), "claimed");
        // Removed: no limit, no row.
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.set_budget('tool_calls', NULL, 'run', run_id => 'r')"
            ),
            0
        );
        assert_eq!(outcome("d"), "claimed");
    }

    /// record_cost never refuses money already spent, and may push a budget over; the next llm
    /// step is refused (created paused with the budget), the scope's runs are not handed out,
    /// the warning is written once per window, and a new window starts the count over.
    #[pg_test]
    fn costs_push_a_budget_over_and_the_next_decision_is_refused() {
        running_run("t-budget-money");
        Spi::run(
            "SELECT ledger.set_budget('usd', 1.00, period => 'day'); \
             SELECT ledger.create_run('agent', run_id => 'queued'); \
             SELECT ledger.record_cost('r', 'tokens', 1, 0.60, 'USD')",
        )
        .unwrap();
        assert_eq!(events("budget.warning"), 0);
        assert_eq!(
            one::<String>("SELECT status FROM ledger.create_step('r', 'llm', step_key => 'plan')"),
            "queued"
        );
        let second =
            one::<String>("SELECT id FROM ledger.record_cost('r', 'tokens', 1, 0.60, 'USD')");
        assert!(second.starts_with("cost_"));
        assert_eq!(
            events("budget.warning"),
            2,
            "once, to the feed and the outbox"
        );
        Spi::run("SELECT ledger.record_cost('r', 'tokens', 1, 0.01, 'USD')").unwrap();
        assert_eq!(events("budget.warning"), 2, "once per window");
        assert_eq!(
            one::<String>(
                "SELECT concat_ws('|', level, unit, period, spent, remaining, exhausted, warned, \
                        window_end - window_start = interval '1 day') FROM ledger.budget_usage"
            ),
            "workspace|USD|day|1.21|0|t|t|t"
        );
        assert_eq!(
            one::<String>(
                "SELECT concat_ws('|', status, error_code, error_details->>'unit') \
                   FROM ledger.create_step('r', 'llm', step_key => 'answer')"
            ),
            "paused|BUDGET_EXHAUSTED|USD"
        );
        assert_eq!(
            one::<String>("SELECT status FROM ledger.runs WHERE id = 'r'"),
            "paused"
        );
        // Other steps are not decisions to spend.
        assert_eq!(
            one::<String>("SELECT status FROM ledger.create_step('r', 'retrieval')"),
            "queued"
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_run('w1')"),
            0,
            "the workspace's runs wait for the budget"
        );
        // A person raises it: the run is claimable, and the refused step is decided again.
        Spi::run("SELECT ledger.set_budget('USD', 5, period => 'day', actor => 'ops')").unwrap();
        assert_eq!(
            one::<String>("SELECT run_id FROM ledger.claim_run('w1')"),
            "queued"
        );
        assert_eq!(
            one::<String>(
                "SELECT status || ':' || coalesce(error_code, '-') FROM ledger.create_step('r', 'llm', step_key => 'answer')"
            ),
            "paused:-"
        );
        // The next day counts from nothing.
        Spi::run("SELECT ledger.set_budget('USD', 1, period => 'day')").unwrap();
        Spi::run("UPDATE ledger.budgets SET window_start = window_start - interval '1 day'")
            .unwrap();
        assert_eq!(
            one::<String>(
                "SELECT spent || '|' || exhausted || '|' || warned FROM ledger.budget_usage"
            ),
            "0|false|false"
        );
        Spi::run("SELECT ledger.record_cost('r', 'tokens', 1, 0.5, 'USD')").unwrap();
        assert_eq!(
            one::<String>("SELECT spent::text FROM ledger.budget_usage"),
            "0.5"
        );
    }

    /// A tenant's budget counts tokens across its workspaces; each workspace sees it.
    #[pg_test]
    fn a_tenants_budget_counts_every_workspace() {
        set_scope("t-budget-tenant", "w1");
        Spi::run(
            "SELECT ledger.set_budget('tokens', 1000, 'tenant'); \
             SELECT ledger.create_run('agent', run_id => 'a'); \
             SELECT ledger.record_cost('a', 'tokens', 1, usage => '{\"input_tokens\": 600, \"output_tokens\": 200}')",
        )
        .unwrap();
        set_scope("t-budget-tenant", "w2");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'b'); \
             SELECT ledger.transition_run('b', 'running'); \
             SELECT ledger.record_cost('b', 'tokens', 1, usage => '{\"total_tokens\": 300}')",
        )
        .unwrap();
        assert_eq!(
            one::<String>("SELECT level || ':' || spent FROM ledger.budget_usage"),
            "tenant:1100"
        );
        assert_eq!(
            one::<String>(
                "SELECT ledger.claim_tool_call('b', 'search', '{}', tool_call_id => 'x')->>'outcome'"
            ),
            "budget_exhausted"
        );
        // Another tenant is not limited by it.
        set_scope("t-budget-other", "w2");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'b')").unwrap();
        assert_eq!(
            one::<String>(
                "SELECT ledger.claim_tool_call('b', 'search', '{}', tool_call_id => 'x')->>'outcome'"
            ),
            "claimed"
        );
    }

    /// Batch claims stop at the budget: the calls past it answer budget_exhausted.
    #[pg_test]
    fn a_batch_stops_at_the_budget() {
        running_run("t-budget-batch");
        Spi::run("SELECT ledger.set_budget('tool_calls', 2)").unwrap();
        assert_eq!(
            one::<String>(
                "SELECT string_agg(claim->>'outcome', ' ' ORDER BY index) FROM ledger.claim_tool_calls('r', \
                   '[{\"tool_ref\": \"a\"}, {\"tool_ref\": \"b\"}, {\"tool_ref\": \"c\"}, {\"tool_ref\": \"d\"}]')"
            ),
            "claimed claimed budget_exhausted budget_exhausted"
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_events WHERE event_type = 'run.status'"),
            2,
            "running, then parked once"
        );
    }

    #[pg_test]
    fn bad_budgets_are_refused() {
        running_run("t-budget-bad");
        for (query, state, code) in [
            (
                "SELECT ledger.set_budget('dollars!', 1)",
                "22023",
                "UNIT_INVALID",
            ),
            (
                "SELECT ledger.set_budget(NULL, 1)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.set_budget('USD', -1)",
                "22023",
                "AMOUNT_INVALID",
            ),
            (
                "SELECT ledger.set_budget('USD', 'NaN')",
                "22023",
                "AMOUNT_INVALID",
            ),
            (
                "SELECT ledger.set_budget('USD', 1, 'team')",
                "22023",
                "LEVEL_UNKNOWN",
            ),
            (
                "SELECT ledger.set_budget('USD', 1, period => 'week')",
                "22023",
                "PERIOD_UNKNOWN",
            ),
            (
                "SELECT ledger.set_budget('USD', 1, warn_ratio => 1.5)",
                "22023",
                "RATIO_INVALID",
            ),
            (
                "SELECT ledger.set_budget('USD', 1, 'run')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.set_budget('USD', 1, run_id => 'r')",
                "22023",
                "ARGUMENT_CONFLICT",
            ),
            (
                "SELECT ledger.set_budget('USD', 1, 'run', run_id => 'nope')",
                "P0002",
                "RUN_NOT_FOUND",
            ),
        ] {
            assert_error(query, state, code);
        }
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.budgets"), 0);
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.audit_events WHERE gateway_type = 'budget.set'"
            ),
            0
        );
    }
}
