//! No argument multiplies a backend's memory: each function called with the largest input it
//! accepts (or a large one it refuses) raises its backend's peak resident memory (VmHWM, read
//! by the server from /proc) by a bounded multiple of that input, never by gigabytes.
//!
//! `#[ignore]`d like every session test; `pgrx-tests/test.sh` runs them with `-- --ignored`.

mod common;
use common::*;

use postgres::Client;

const MIB: i64 = 1024 * 1024;

/// The peak resident memory of `c`'s backend so far, in bytes, read as the superuser.
fn peak(admin: &mut Client, c: &mut Client) -> i64 {
    let pid: i32 = one(c, "SELECT pg_backend_pid()");
    let status: String = one(admin, &format!("SELECT pg_read_file('/proc/{pid}/status')"));
    let kb: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kb * 1024
}

/// A fresh session of `db` with a running run `r`, a step `s`, a claimed call `c0` and a task
/// `t`, warmed up (every code path loaded once) so that only the big call's memory counts.
fn session_with_fixture(db: &str, n: usize) -> Client {
    let mut c = session(db);
    exec(
        &mut c,
        &format!(
            "SELECT ledger.create_run('chat', run_id => 'r{n}'); \
             SELECT ledger.transition_run('r{n}', 'running'); \
             SELECT ledger.create_step('r{n}', 'llm', step_id => 's{n}'); \
             SELECT ledger.claim_tool_call('r{n}', 'search', '{{\"q\": 1}}', tool_call_id => 'c{n}'); \
             SELECT ledger.create_task('k', task_id => 't{n}'); \
             SELECT ledger.record_audit('r{n}', 'gw', 'allow', '{{\"a\": 1}}'); \
             SELECT ledger.transition_step('s{n}', 'running', metrics => '{{\"a\": 1}}', output_summary => 'x')"
        ),
    );
    c
}

#[test]
#[ignore]
fn no_argument_multiplies_a_backends_memory() {
    let db = database("ledger_memory");
    let mut admin = connect_to(&db, "postgres");
    // (what, input bytes, how many times the input the ledger may add to the peak, the
    // argument, the statement with `$A` for it): `{n}` names the session's own fixture. What
    // counts is the peak beyond that of building the argument alone (`pg_column_size($A)` in a
    // fresh session of its own). A JSON document is printed, parsed, redacted, serialised and
    // parsed back by jsonb_in on its way to a table, and the stored row is returned.
    let text = 32 * MIB;
    // The largest JSON argument accepted, less the 9 bytes of `{"q": ""}`.
    let json = 16 * MIB - 9;
    let repeat = |c: char, n: i64| format!("repeat('{c}', {n})");
    let doc = |n: i64| format!("jsonb_build_object('q', repeat('a', {n}))");
    let numbers = |n: i64| {
        format!("jsonb_build_object('q', (SELECT jsonb_agg(1) FROM generate_series(1, {n})))")
    };
    let cases: Vec<(&str, i64, i64, String, &str)> = vec![
        ("a 32 MiB tool_ref (refused)", text, 1, repeat('t', text),
         "SELECT ledger.claim_tool_call('r{n}', $A)"),
        ("a 32 MiB idempotency key (refused)", text, 1, repeat('k', text),
         "SELECT ledger.claim_tool_call('r{n}', 'search', idempotency_key => $A)"),
        ("a 32 MiB status (refused)", text, 1, repeat('s', text),
         "SELECT ledger.transition_run('r{n}', $A)"),
        ("a 32 MiB error message (cut)", text, 1, repeat('e', text),
         "SELECT ledger.transition_run('r{n}', 'failed', error_message => $A)"),
        ("a 32 MiB comment (cut)", text, 1, repeat('c', text),
         "SELECT ledger.record_feedback('r{n}', 1, comment => $A)"),
        ("16 MiB tool-call arguments", json, 16, doc(json),
         "SELECT ledger.claim_tool_call('r{n}', 'search', $A, tool_call_id => 'big')"),
        ("a 16 MiB tool result", json, 16, doc(json),
         "SELECT ledger.complete_tool_call((SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = 'c{n}'), 1, 'succeeded', $A)"),
        ("16 MiB run inputs", json, 16, doc(json),
         "SELECT ledger.create_run('chat', $A)"),
        ("a 16 MiB audit payload", json, 16, doc(json),
         "SELECT ledger.record_audit('r{n}', 'gw', 'allow', $A)"),
        ("a 16 MiB task checkpoint", json, 16, doc(json),
         "SELECT ledger.add_task_checkpoint('t{n}', $A)"),
        ("a 32 MiB audit payload (refused)", 2 * json, 4, doc(2 * json),
         "SELECT ledger.record_audit('r{n}', 'gw', 'allow', $A)"),
        ("a 16 MiB artifact", json, 16, format!("convert_to({}, 'UTF8')", repeat('a', json)),
         "SELECT ledger.put_artifact('r{n}', $A)"),
        // A parsed value takes a few hundred bytes however short its text: counted, not sized.
        ("tool-call arguments of 199,998 numbers", 2 * 200_000, 200, numbers(199_998),
         "SELECT ledger.claim_tool_call('r{n}', 'search', $A, tool_call_id => 'many')"),
        ("metrics of 1,000,000 numbers (refused)", 2 * 1_000_000, 4, numbers(1_000_000),
         "SELECT ledger.transition_step('s{n}', 'running', metrics => $A)"),
    ];
    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut grown = |n: usize, sql: &str| -> (i64, String) {
        let mut c = session_with_fixture(&db, n);
        let before = peak(&mut admin, &mut c);
        let outcome = match c.batch_execute(sql) {
            Ok(()) => "accepted".to_owned(),
            Err(e) => {
                let (state, code) = failure(&e);
                format!("refused {state} {code}")
            }
        };
        (peak(&mut admin, &mut c) - before, outcome)
    };
    for (i, (what, input, times, argument, template)) in cases.iter().enumerate() {
        let (building, _) = grown(2 * i, &format!("SELECT pg_column_size({argument})"));
        let sql = template
            .replace("$A", argument)
            .replace("{n}", &(2 * i + 1).to_string());
        let (total, outcome) = grown(2 * i + 1, &sql);
        let added = total - building;
        report.push(format!(
            "{what}: {outcome}; peak +{} MiB, of which the ledger's {} MiB ({:.1} x the input)",
            total / MIB,
            added / MIB,
            added as f64 / *input as f64
        ));
        // Never one copy per event, column or index the ledger writes.
        if added > times * input + 64 * MIB {
            failures.push(what.to_string());
        }
    }
    println!("{}", report.join("\n"));
    assert!(
        failures.is_empty(),
        "memory multiplied by {failures:?}:\n{}",
        report.join("\n")
    );
}
