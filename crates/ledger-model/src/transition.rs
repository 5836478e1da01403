//! The conditional status UPDATE of a run, step or task (the extension's `transition.rs` runs
//! it): its text, built here so that the write-statement forms test reads the statements the
//! extension sends.

use crate::status::Resource;

/// What a resource's transition writes besides the status and the times.
pub struct Columns {
    pub resource: Resource,
    pub table: &'static str,
    /// The resource's own `SET` clauses; their parameters are `$5` to `$(4 + own)`.
    pub set: &'static str,
    /// How many parameters `set` has.
    pub own: usize,
    /// A condition over those parameters under which the row starts over: `started_at` is
    /// cleared instead of stamped.
    pub restart: Option<&'static str>,
    /// The column `duration_ms` counts from when the row never started; None: no duration.
    pub duration_from: Option<&'static str>,
}

/// A run's: its summary and error, and the end of the owner's lease when the run ends (`$9`:
/// the new status is terminal).
pub const RUN: Columns = Columns {
    resource: Resource::Run,
    table: "ledger.runs",
    set: "output_summary = coalesce($5, output_summary), \
          error_code = coalesce($6, error_code), \
          error_message = coalesce($7, error_message), \
          error_step_id = coalesce($8, error_step_id), \
          lease_expires_at = CASE WHEN $9 THEN NULL ELSE lease_expires_at END",
    own: 5,
    restart: None,
    duration_from: Some("queued_at"),
};

/// A step's: its summary, metrics (merged by top-level key) and error.
pub const STEP: Columns = Columns {
    resource: Resource::Step,
    table: "ledger.run_steps",
    set: "output_summary = coalesce($5, output_summary), \
          metrics = metrics || coalesce($6, '{}'::jsonb), \
          error_code = coalesce($7, error_code), \
          error_message = coalesce($8, error_message), \
          error_details = coalesce($9, error_details)",
    own: 5,
    restart: None,
    duration_from: Some("created_at"),
};

/// A task's: progress (merged by top-level key), output, error, the replacement's id, and with
/// `$10` a new attempt, which starts everything over.
pub const TASK: Columns = Columns {
    resource: Resource::Task,
    table: "ledger.tasks",
    set:
        "progress = CASE WHEN $10 THEN '{}'::jsonb ELSE progress END || coalesce($5, '{}'::jsonb), \
          output = CASE WHEN $10 THEN NULL ELSE coalesce($6, output) END, \
          error_code = CASE WHEN $10 THEN NULL ELSE coalesce($7, error_code) END, \
          error_message = CASE WHEN $10 THEN NULL ELSE coalesce($8, error_message) END, \
          retried_as_task_id = coalesce($9, retried_as_task_id), \
          attempt_count = attempt_count + CASE WHEN $10 THEN 1 ELSE 0 END",
    own: 6,
    restart: Some("$10"),
    duration_from: None,
};

/// The UPDATE of `columns`: `$1`, `$2` the scope, `$3` the id, `$4` the new status, the own
/// parameters, then `started` (the new status counts as started), `terminal`, `from` (the status
/// the row must still be in) and `now` (the transaction's time, a parameter: a distributed engine
/// refuses `now()` inside CASE or COALESCE of a write).
pub fn statement(columns: &Columns) -> String {
    let started = 5 + columns.own;
    let (terminal, from, now) = (started + 1, started + 2, started + 3);
    let Columns {
        table,
        set,
        restart,
        duration_from,
        ..
    } = columns;
    let restart = restart.map_or(String::new(), |r| format!("WHEN {r} THEN NULL "));
    let duration = duration_from.map_or(String::new(), |column| {
        format!(
            ", duration_ms = CASE WHEN ${terminal} THEN \
                 (extract(epoch FROM ${now} - coalesce(started_at, {column})) * 1000)::bigint END"
        )
    });
    format!(
        "UPDATE {table} SET status = $4, updated_at = ${now}, {set}, \
             started_at = CASE {restart}WHEN ${started} THEN coalesce(started_at, ${now}) \
                               ELSE started_at END, \
             ended_at = CASE WHEN ${terminal} THEN ${now} END{duration} \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 AND status = ${from} \
          RETURNING id"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_times_follow_the_own_parameters() {
        let run = statement(&RUN);
        assert!(run.contains("CASE WHEN $10 THEN coalesce(started_at, $13)"));
        assert!(run.contains("status = $12") && run.contains("ended_at = CASE WHEN $11 THEN $13"));
        let task = statement(&TASK);
        assert!(task.contains("WHEN $10 THEN NULL WHEN $11 THEN coalesce(started_at, $14)"));
        assert!(!task.contains("duration_ms"));
    }
}
