//! Test-only code, built for `#[pg_test]`s alone: helpers to run SQL and capture the error it
//! raises, as the client sees it, and the hostile-input tests (`hostile`).

use pgrx::prelude::*;

mod hostile;

#[pg_schema]
mod tests {
    pgrx::extension_sql!(
        r#"
CREATE FUNCTION tests.error_of(query text) RETURNS jsonb LANGUAGE plpgsql AS $fn$
DECLARE state text; msg text; detail text;
BEGIN
    EXECUTE query;
    RETURN NULL;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, msg = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL;
    RETURN jsonb_build_object('sqlstate', state, 'message', msg, 'detail', detail);
END
$fn$;
GRANT USAGE ON SCHEMA tests TO PUBLIC;
"#,
        name = "test_error_of",
    );
}

/// What a failed statement raised.
#[derive(Debug)]
pub struct Raised {
    pub sqlstate: String,
    pub message: String,
    pub detail: serde_json::Value,
}

/// Runs `query` (in a subtransaction, so the test can go on) and returns what it raised;
/// panics if it raised nothing.
pub fn error_of(query: &str) -> Raised {
    let out = Spi::get_one_with_args::<pgrx::JsonB>("SELECT tests.error_of($1)", &[query.into()])
        .expect("error_of runs")
        .unwrap_or_else(|| panic!("expected an error from: {query}"));
    let v = out.0;
    Raised {
        sqlstate: v["sqlstate"].as_str().unwrap_or_default().to_owned(),
        message: v["message"].as_str().unwrap_or_default().to_owned(),
        detail: v["detail"]
            .as_str()
            .and_then(|d| serde_json::from_str(d).ok())
            .unwrap_or(serde_json::Value::Null),
    }
}

/// Asserts `query` fails with `sqlstate` and DETAIL code `code`, and a `ledger: ` message.
pub fn assert_error(query: &str, sqlstate: &str, code: &str) -> Raised {
    let e = error_of(query);
    assert_eq!(e.sqlstate, sqlstate, "{query}: {e:?}");
    assert_eq!(e.detail["code"], code, "{query}: {e:?}");
    assert!(e.message.starts_with("ledger: "), "{query}: {e:?}");
    e
}

pub fn set_scope(tenant: &str, workspace: &str) {
    Spi::run_with_args(
        "SELECT ledger.set_scope($1, $2, true)",
        &[tenant.into(), workspace.into()],
    )
    .expect("set_scope");
}

/// A scope of its own (tenant, workspace "w") with a running run `r`.
pub fn running_run(tenant: &str) {
    set_scope(tenant, "w");
    Spi::run(
        "SELECT ledger.create_run('agent', run_id => 'r'), ledger.transition_run('r', 'running')",
    )
    .expect("a running run");
}

pub fn one<T: pgrx::FromDatum + pgrx::IntoDatum>(query: &str) -> T {
    Spi::get_one::<T>(query)
        .expect(query)
        .unwrap_or_else(|| panic!("NULL from {query}"))
}
