//! `ledger`: an AI agent runtime's run ledger inside PostgreSQL.
//!
//! Pure logic lives in the workspace crate `ledger-model` (crates/ledger-model: no Postgres calls,
//! no pgrx, plain `#[test]`s), imported as `ledger_model::...`; the modules of this crate are thin
//! SPI layers exposing it as SQL functions in schema `ledger`.

use pgrx::prelude::*;

mod artifacts;
mod audit;
mod budgets;
mod channels;
mod concurrency;
mod db;
mod error;
mod evidence;
mod feed;
mod graph_checkpoints;
mod guc;
mod inbox;
mod jsonb;
mod mailbox;
mod notifier;
mod outbox;
mod redaction;
mod retention;
mod rows;
mod run_leases;
mod runs;
mod schedules;
mod scope;
mod steps;
mod tasks;
mod tool_calls;
mod transition;
mod waits;

::pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "ledger_schema", bootstrap);
extension_sql_file!(
    "../sql/tasks.sql",
    name = "ledger_tasks",
    requires = ["ledger_schema"]
);
extension_sql_file!(
    "../sql/graph_checkpoints.sql",
    name = "ledger_graph_checkpoints",
    requires = ["ledger_schema"]
);
extension_sql_file!(
    "../sql/views.sql",
    name = "ledger_views",
    requires = ["ledger_schema", scope::scope_required]
);
extension_sql_file!("../sql/finalize.sql", name = "ledger_finalize", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    guc::init();
    channels::init();
    notifier::init();
    ledger_model::interrupt::install(check_for_interrupts);
}

/// PostgreSQL's interrupt check: a pending cancel or termination raises its ERROR (or FATAL)
/// here, which unwinds the pure work that called it and aborts the statement as usual.
fn check_for_interrupts() {
    pgrx::check_for_interrupts!();
}

/// The allowed status transitions of runs, steps and tasks, as held in Rust (`ledger_model::status`).
#[pg_extern(immutable, parallel_safe)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn status_transitions() -> TableIterator<
    'static,
    (
        name!(resource, String),
        name!(from_status, String),
        name!(to_status, String),
    ),
> {
    use ledger_model::status::Resource;
    TableIterator::new(Resource::ALL.into_iter().flat_map(|r| {
        r.transitions().map(move |(from, to)| {
            (
                r.as_str().to_owned(),
                from.as_str().to_owned(),
                to.as_str().to_owned(),
            )
        })
    }))
}

/// Whether `status` is one of `resource`'s statuses. The tables' status CHECKs call it: the
/// same rule as a CHECK over a list of names, which PostgreSQL would parse again from its stored
/// text at every INSERT and UPDATE (the status lists were about a tenth of a tool call's CPU).
/// No pinned search_path: it reads nothing, and a SET clause would make every call set it.
#[pg_extern(immutable, strict, parallel_safe, requires = ["ledger_schema"])]
fn is_status(resource: &str, status: &str) -> std::result::Result<bool, error::SqlError> {
    use ledger_model::status::{CallStatus, Resource, Status};
    let of = |r: Resource| Status::from_name(status).is_some_and(|s| r.has(s));
    let answer: error::Result<bool> = match resource {
        "run" => Ok(of(Resource::Run)),
        "step" => Ok(of(Resource::Step)),
        "task" => Ok(of(Resource::Task)),
        "tool_call" => Ok(CallStatus::from_name(status).is_some()),
        _ => Err(error::LedgerError::new(
            error::Code::StatusUnknown,
            "unknown resource: expected run, step, task or tool_call",
        )
        .with("resource", ledger_model::text::truncate_chars(resource, 64))),
    };
    Ok(answer?)
}

extension_sql!(
    r#"
-- The status CHECKs, added once ledger.is_status exists (the tables come first).
ALTER TABLE ledger.runs ADD CONSTRAINT runs_status_check CHECK (ledger.is_status('run', status));
ALTER TABLE ledger.run_steps ADD CONSTRAINT run_steps_status_check CHECK (ledger.is_status('step', status));
ALTER TABLE ledger.tasks ADD CONSTRAINT tasks_status_check CHECK (ledger.is_status('task', status));
ALTER TABLE ledger.run_step_tool_calls
    ADD CONSTRAINT run_step_tool_calls_status_check CHECK (ledger.is_status('tool_call', status));
"#,
    name = "ledger_status_checks",
    requires = ["ledger_schema", "ledger_tasks", is_status]
);

// Test-only code: helpers for the #[pg_test]s and the hostile-input tests (src/testing/).
#[cfg(any(test, feature = "pg_test"))]
mod testing;

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, error_of, one, running_run, set_scope};
    use pgrx::prelude::*;

    #[pg_test]
    fn status_transitions_lists_the_whole_table() {
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.status_transitions() WHERE resource = 'run'"),
            40
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.status_transitions() WHERE resource = 'step'"),
            42
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.status_transitions() WHERE resource = 'task'"),
            40
        );
        assert_eq!(
            one::<String>("SELECT string_agg(to_status, ',') FROM ledger.status_transitions() WHERE resource = 'run' AND from_status = 'failed'"),
            "retrying"
        );
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.status_transitions() WHERE from_status IN ('succeeded', 'skipped')"), 0);
    }

    #[pg_test]
    fn the_status_checks_refuse_what_is_status_refuses() {
        assert!(one::<bool>("SELECT ledger.is_status('step', 'skipped')"));
        assert!(!one::<bool>("SELECT ledger.is_status('run', 'skipped')"));
        assert!(one::<bool>(
            "SELECT ledger.is_status('tool_call', 'in_doubt')"
        ));
        assert!(!one::<bool>("SELECT ledger.is_status('task', 'in_doubt')"));
        assert_error(
            "SELECT ledger.is_status('nope', 'queued')",
            "22023",
            "STATUS_UNKNOWN",
        );
        running_run("t-status-check");
        Spi::run("SELECT ledger.create_step('r', 'tool', step_id => 's')").unwrap();
        Spi::run("SELECT ledger.create_task('index', task_id => 't')").unwrap();
        Spi::run("SELECT ledger.claim_tool_call('r', 'search', tool_call_id => 'c')").unwrap();
        // The owner's direct writes (the functions never write an unknown status) are refused.
        for (table, check) in [
            ("runs", "runs_status_check"),
            ("run_steps", "run_steps_status_check"),
            ("tasks", "tasks_status_check"),
            ("run_step_tool_calls", "run_step_tool_calls_status_check"),
        ] {
            let e = error_of(&format!("UPDATE ledger.{table} SET status = 'skipping'"));
            assert_eq!(e.sqlstate, "23514", "{table}: {e:?}");
            assert!(e.message.contains(check), "{table}: {e:?}");
        }
    }

    #[pg_test]
    fn every_function_pins_search_path_and_none_is_public() {
        // The exceptions: a SET clause would undo set_scope's is_local setting, would stop
        // the policy and budget helpers (SQL-standard bodies, names resolved at creation) being
        // inlined,
        // and would make every status CHECK (is_status, which reads nothing) set it.
        let unpinned = one::<String>(
            "SELECT coalesce(string_agg(p.proname, ','), '') FROM pg_proc p \
              WHERE p.pronamespace = 'ledger'::regnamespace \
                AND p.proname NOT IN ('set_scope', 'scope_tenant', 'scope_workspace', 'is_status', \
                                    'budget_window', 'budget_spent') \
                AND NOT EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%')",
        );
        assert_eq!(unpinned, "");
        let public = one::<String>(
            "SELECT coalesce(string_agg(p.proname, ','), '') FROM pg_proc p \
              WHERE p.pronamespace = 'ledger'::regnamespace AND has_function_privilege('public', p.oid, 'EXECUTE')",
        );
        assert_eq!(public, "");
        assert!(one::<bool>(
            "SELECT bool_and(proowner = 'ledger_owner'::regrole) FROM pg_proc WHERE pronamespace = 'ledger'::regnamespace"
        ));
    }

    mod write_statements {
        include!("../crates/ledger-model/tests/statement_forms/volatility.rs");
    }

    /// The volatility the write-statement forms test (crates/ledger-model/tests/
    /// statement_forms.rs) knows each function by is the catalog's, for the most volatile
    /// overload ('i' < 's' < 'v').
    #[pg_test]
    fn write_statement_functions_have_their_listed_volatility() {
        for (name, listed) in write_statements::VOLATILITY {
            let found = Spi::get_one_with_args::<String>(
                "SELECT max(provolatile::text) FROM pg_catalog.pg_proc \
                  WHERE proname = $1 \
                    AND pronamespace IN ('pg_catalog'::regnamespace, 'ledger'::regnamespace)",
                &[(*name).into()],
            )
            .expect("a catalog read");
            assert_eq!(found, Some(listed.to_string()), "{name}");
        }
    }

    #[pg_test]
    fn every_function_and_table_has_a_comment() {
        let bare = one::<String>(
            "SELECT coalesce(string_agg(oid::regprocedure::text, ', '), '') FROM pg_proc \
              WHERE pronamespace = 'ledger'::regnamespace AND obj_description(oid, 'pg_proc') IS NULL",
        );
        assert_eq!(bare, "");
        let bare = one::<String>(
            "SELECT coalesce(string_agg(relname, ', '), '') FROM pg_class \
              WHERE relnamespace = 'ledger'::regnamespace AND relkind IN ('r', 'v') \
                AND obj_description(oid, 'pg_class') IS NULL",
        );
        assert_eq!(bare, "");
    }

    /// docs/reference.md documents every function exactly as it is: a heading with its
    /// signature as PostgreSQL prints it (defaults without their casts) and its COMMENT quoted
    /// under it, and no heading for a function that does not exist.
    #[pg_test]
    fn the_reference_documents_every_function_with_its_comment() {
        let reference = include_str!("../docs/reference.md");
        let lines: Vec<&str> = reference.lines().collect();
        let functions = Spi::connect(|client| {
            client
                .select(
                    "SELECT format('### ledger.%s(%s) → %s', p.proname, \
                                   regexp_replace(pg_get_function_arguments(p.oid), '::[a-z ]+(\\[\\])?', '', 'g'), \
                                   pg_get_function_result(p.oid)), \
                            '> ' || obj_description(p.oid, 'pg_proc') \
                       FROM pg_proc p WHERE p.pronamespace = 'ledger'::regnamespace ORDER BY 1",
                    None,
                    &[],
                )
                .unwrap()
                .map(|r| {
                    (
                        r.get::<String>(1).unwrap().unwrap(),
                        r.get::<String>(2).unwrap().unwrap(),
                    )
                })
                .collect::<Vec<_>>()
        });
        let mut missing = Vec::new();
        for (heading, comment) in &functions {
            let at = lines.iter().position(|l| l == heading);
            // The COMMENT is the first non-empty line under the heading.
            let quoted = at.and_then(|i| lines[i + 1..].iter().find(|l| !l.is_empty()));
            if quoted != Some(&comment.as_str()) {
                missing.push(heading.as_str());
            }
        }
        assert!(
            missing.is_empty(),
            "not documented as they are: {missing:#?}"
        );
        let documented = lines
            .iter()
            .filter(|l| l.starts_with("### ledger."))
            .count();
        assert_eq!(documented, functions.len(), "a heading names no function");
    }

    #[pg_test]
    fn every_table_forces_rls_and_is_dumped() {
        let tables = "SELECT c.oid FROM pg_class c WHERE c.relnamespace = 'ledger'::regnamespace AND c.relkind = 'r'";
        assert!(one::<i64>(&format!("SELECT count(*) FROM ({tables}) t")) >= 5);
        assert!(one::<bool>(&format!(
            "SELECT bool_and(relrowsecurity AND relforcerowsecurity AND relowner = 'ledger_owner'::regrole) FROM pg_class WHERE oid IN ({tables})"
        )));
        assert!(one::<bool>(&format!(
            "SELECT bool_and(oid = ANY (SELECT unnest(extconfig) FROM pg_extension WHERE extname = 'ledger')) FROM ({tables}) t"
        )));
        // Every primary, unique and foreign key leads with the scope.
        assert_eq!(
            one::<String>(
                "SELECT coalesce(string_agg(conname, ','), '') FROM pg_constraint \
                  WHERE connamespace = 'ledger'::regnamespace AND contype IN ('p', 'u', 'f') \
                    AND pg_get_constraintdef(oid) NOT LIKE '%(tenant_id, workspace_id%'"
            ),
            ""
        );
    }

    #[pg_test]
    fn application_roles_cannot_write_tables_directly() {
        set_scope("t-roles", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        Spi::run("SET LOCAL ROLE ledger_writer").unwrap();
        // The functions work for the writer ...
        Spi::run("SELECT ledger.transition_run('r', 'running')").unwrap();
        // ... but plain writes do not.
        for sql in [
            "UPDATE ledger.runs SET status = 'succeeded'",
            "INSERT INTO ledger.run_events (tenant_id, workspace_id, id, run_id, seq, event_type) VALUES ('t-roles', 'w', 'e', 'r', 99, 'forged')",
            "DELETE FROM ledger.run_events",
            "UPDATE ledger.outbox SET status = 'done'",
        ] {
            let e = error_of(sql);
            assert_eq!(e.sqlstate, "42501", "{sql}: {e:?}");
        }
        Spi::run("RESET ROLE").unwrap();
        assert_eq!(
            one::<String>("SELECT status FROM ledger.runs WHERE tenant_id = 't-roles'"),
            "running"
        );
        // A reader may not even call the writing functions.
        Spi::run("SET LOCAL ROLE ledger_reader").unwrap();
        assert_eq!(
            error_of("SELECT ledger.create_run('chat')").sqlstate,
            "42501"
        );
    }

    #[pg_test]
    fn a_role_without_scope_sees_no_rows() {
        set_scope("t-rls", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        Spi::run("SET LOCAL ROLE ledger_reader").unwrap();
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.runs"), 1);
        Spi::run("SELECT set_config('ledger.tenant_id', '', true)").unwrap();
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.runs"), 0);
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_events"), 0);
        set_scope("t-rls-other", "w");
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.runs"), 0);
        // Through the functions, another workspace's run does not exist.
        Spi::run("RESET ROLE").unwrap();
        assert_error(
            "SELECT ledger.transition_run('r', 'running')",
            "P0002",
            "RUN_NOT_FOUND",
        );
    }
}

/// Required by `#[pg_test]`: called once before the test cluster starts.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
