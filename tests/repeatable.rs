//! The repeatable path with real sessions: records racing each other (one run, and two runs
//! under one key) and a lookup that never waits for a writer. Run like tests/sessions.rs
//! (`-- --ignored`).

mod common;

use common::*;
use postgres::Client;
use std::thread;

/// Records the call `key` of run `run` with result `{"by": by}`: (outcome, the result answered).
fn record(c: &mut Client, run: &str, key: &str, by: &str) -> (String, Option<String>) {
    let row = c
        .query_one(
            "SELECT r->>'outcome', r->'response'->'result'->>'by' FROM ledger.record_tool_call($1, 'fx.rate', '{}', \
               'succeeded', jsonb_build_object('by', $3::text), tool_call_id => 'c1', idempotency_key => $2) r",
            &[&run, &key, &by],
        )
        .unwrap_or_else(|e| panic!("record {run} {key}: {e}"));
    (row.get(0), row.get(1))
}

fn setup(name: &str) -> (String, Client) {
    let db = database(name);
    let mut c = session(&db);
    for run in ["ra", "rb"] {
        exec(
            &mut c,
            &format!("SELECT ledger.create_run('agent', run_id => '{run}'); SELECT ledger.transition_run('{run}', 'running')"),
        );
    }
    (db, c)
}

#[test]
#[ignore]
fn a_record_racing_another_of_its_run_answers_the_first_and_writes_nothing() {
    let (db, mut first) = setup("ledger_rep_race_run");
    exec(&mut first, "BEGIN");
    assert_eq!(record(&mut first, "ra", "k", "first").0, "recorded");
    let mut second = session(&db);
    let pid: i32 = one(&mut second, "SELECT pg_backend_pid()");
    let racing = thread::spawn(move || {
        let answer = record(&mut second, "ra", "k", "second");
        (answer, second)
    });
    wait_until_blocked(&mut first, pid);
    // A lookup waits for no writer: it answers from what is committed, and takes no transaction
    // id (nothing to commit, no WAL to flush).
    let mut third = session(&db);
    exec(&mut third, "BEGIN");
    assert_eq!(
        one::<String>(
            &mut third,
            "SELECT ledger.find_tool_call('ra', 'fx.rate', '{}', tool_call_id => 'c1', idempotency_key => 'k')->>'outcome'"
        ),
        "unrecorded"
    );
    assert!(one::<bool>(
        &mut third,
        "SELECT txid_current_if_assigned() IS NULL"
    ));
    exec(&mut third, "COMMIT");
    exec(&mut first, "COMMIT");
    let last_seq: i64 = one(
        &mut third,
        "SELECT last_seq FROM ledger.runs WHERE id = 'ra'",
    );
    let ((outcome, by), mut second) = racing.join().unwrap();
    assert_eq!(
        (outcome.as_str(), by.as_deref()),
        ("replayed", Some("first"))
    );
    assert_eq!(
        one::<i64>(
            &mut second,
            "SELECT last_seq FROM ledger.runs WHERE id = 'ra'"
        ),
        last_seq,
        "the second record wrote nothing"
    );
    assert_eq!(
        one::<i64>(
            &mut second,
            "SELECT count(*) FROM ledger.run_step_tool_calls"
        ),
        1
    );
}

#[test]
#[ignore]
fn records_of_two_runs_under_one_key_keep_the_first() {
    let (db, mut first) = setup("ledger_rep_race_key");
    exec(&mut first, "BEGIN");
    assert_eq!(record(&mut first, "ra", "shared", "ra").0, "recorded");
    let mut second = session(&db);
    let pid: i32 = one(&mut second, "SELECT pg_backend_pid()");
    // The second run's insert waits on the key's unique index, then finds the first record.
    let racing = thread::spawn(move || {
        let answer = record(&mut second, "rb", "shared", "rb");
        (answer, second)
    });
    wait_until_blocked(&mut first, pid);
    exec(&mut first, "COMMIT");
    let ((outcome, by), mut second) = racing.join().unwrap();
    assert_eq!((outcome.as_str(), by.as_deref()), ("replayed", Some("ra")));
    assert_eq!(
        one::<String>(
            &mut second,
            "SELECT string_agg(run_id || ':' || status || ':' || (result->>'by'), ',') FROM ledger.run_step_tool_calls"
        ),
        "ra:succeeded:ra"
    );
    // The run that reused it says so in its feed and its evidence, once.
    assert_eq!(
        one::<i64>(
            &mut second,
            "SELECT count(*) FROM ledger.events_since('rb') WHERE event_type = 'tool_call.replayed'"
        ),
        1
    );
    assert_eq!(record(&mut second, "rb", "shared", "rb").0, "replayed");
    assert_eq!(
        one::<i32>(
            &mut second,
            "SELECT jsonb_array_length(ledger.replay_bundle('rb')->'reused_tool_calls')"
        ),
        1
    );
}
