//! Batch claims with real sessions: workers claiming the parallel tool calls of one model turn
//! (`claim_tool_calls`) at the same time. Run like tests/sessions.rs (`-- --ignored`).

mod common;

use common::*;
use postgres::Client;
use std::sync::{Arc, Barrier};
use std::thread;

const ROUNDS: usize = 25;

/// The turn of `round` as worker `w` sends it: four calls, three shared with the other worker
/// (in another order) and one of its own.
fn turn(round: usize, w: usize) -> String {
    let mut calls: Vec<String> = ["a", "b", "c", &format!("own{w}")]
        .iter()
        .map(|c| {
            format!(
                r#"{{"tool_ref": "search", "arguments": {{"q": "{c}"}}, "tool_call_id": "t{round}-{c}"}}"#
            )
        })
        .collect();
    if w == 1 {
        calls[..3].reverse();
    }
    format!("[{}]", calls.join(","))
}

/// Claims (and begins) the turn in one statement and commit, as a worker does; returns the
/// claimed calls (record id, attempt) and every outcome.
fn claim(c: &mut Client, round: usize, w: usize) -> (Vec<(String, i64)>, Vec<String>) {
    let rows = c
        .query(
            "SELECT claim->>'outcome', claim->'tool_call'->>'id', (claim->'tool_call'->>'attempt')::bigint \
               FROM ledger.claim_tool_calls('r', $1::text::jsonb, lease_owner => $2, begin => true) ORDER BY index",
            &[&turn(round, w), &format!("w{w}")],
        )
        .unwrap_or_else(|e| panic!("round {round}, worker {w}: {e}"));
    let outcomes: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let claimed = rows
        .iter()
        .filter(|r| r.get::<_, String>(0) == "claimed")
        .map(|r| (r.get(1), r.get(2)))
        .collect();
    (claimed, outcomes)
}

/// Two workers batch-claim overlapping calls of one run at once, round after round, execute
/// what they were handed and complete it: every call executes exactly once, the other worker
/// sees it `busy` (held) or `replayed` (done), and the ledger's invariants hold.
#[test]
#[ignore]
fn two_workers_batch_claiming_overlapping_calls_execute_each_at_most_once() {
    let db = database("ledger_turns_race");
    let mut setup = session(&db);
    exec(
        &mut setup,
        "SELECT ledger.create_run('agent', run_id => 'r'); \
         SELECT ledger.transition_run('r', 'running'); \
         CREATE TABLE public.executions (call text, worker int)",
    );
    let start = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let (db, start) = (db.clone(), start.clone());
            thread::spawn(move || {
                let mut c = session(&db);
                let mut seen = Vec::new();
                for round in 0..ROUNDS {
                    start.wait();
                    let (claimed, outcomes) = claim(&mut c, round, w);
                    seen.extend(outcomes);
                    for (id, attempt) in claimed {
                        // The request leaves only after the claim committed (autocommit).
                        c.execute(
                            "INSERT INTO public.executions \
                             SELECT tool_call_id, $2 FROM ledger.run_step_tool_calls WHERE id = $1",
                            &[&id, &(w as i32)],
                        )
                        .unwrap();
                        exec(
                            &mut c,
                            &format!(
                                "SELECT ledger.complete_tool_call('{id}', {attempt}, 'succeeded', '{{\"by\": {w}}}')"
                            ),
                        );
                    }
                }
                seen
            })
        })
        .collect();
    let seen: Vec<String> = workers
        .into_iter()
        .flat_map(|w| w.join().expect("a worker"))
        .collect();

    // Each of the 5 calls of every round ran exactly once (the shared ones by either worker).
    let twice: i64 = one(
        &mut setup,
        "SELECT count(*) FROM (SELECT call FROM public.executions GROUP BY call HAVING count(*) > 1) d",
    );
    assert_eq!(twice, 0, "a call executed twice");
    let ran: i64 = one(
        &mut setup,
        "SELECT count(DISTINCT call) FROM public.executions",
    );
    assert_eq!(ran, 5 * ROUNDS as i64);
    // The shared calls were claimed by one worker and answered busy or replayed to the other.
    let count = |o: &str| seen.iter().filter(|s| *s == o).count();
    assert_eq!(count("claimed"), 5 * ROUNDS);
    assert_eq!(count("busy") + count("replayed"), 3 * ROUNDS);
    assert_eq!(seen.len(), 8 * ROUNDS);
    // Every call ended succeeded, once, and a resumed worker's claim replays each of them.
    let succeeded: i64 = one(
        &mut setup,
        "SELECT count(*) FROM ledger.run_step_tool_calls WHERE status = 'succeeded' AND attempt = 1",
    );
    assert_eq!(succeeded, 5 * ROUNDS as i64);
    let mut again = session(&db);
    let (claimed, outcomes) = claim(&mut again, 0, 0);
    assert!(claimed.is_empty());
    assert_eq!(outcomes, vec!["replayed"; 4]);
    let mut admin = connect_to(&db, "postgres");
    assert_eq!(broken_invariants(&mut admin), vec![]);
}

/// A worker that dies after committing its batch with `begin => true` leaves every call of the
/// turn in doubt once the leases expire: the next claim of the turn executes none of them again.
#[test]
#[ignore]
fn a_worker_dying_after_its_begun_batch_commits_leaves_the_turn_in_doubt() {
    let db = database("ledger_turns_crash");
    let mut setup = session(&db);
    exec(
        &mut setup,
        "SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.transition_run('r', 'running')",
    );
    let mut worker = session(&db);
    let (claimed, _) = claim(&mut worker, 0, 0);
    assert_eq!(claimed.len(), 4);
    // The worker's process ends: its connection goes, its commit stays.
    drop(worker);
    exec(
        &mut setup,
        "UPDATE ledger.run_step_tool_calls SET lease_expires_at = clock_timestamp() - interval '1 second'",
    );
    let mut next = session(&db);
    let (claimed, outcomes) = claim(&mut next, 0, 0);
    assert!(claimed.is_empty(), "a begun call was handed out again");
    assert_eq!(outcomes, vec!["in_doubt"; 4]);
    let doubt: i64 = one(
        &mut setup,
        "SELECT count(*) FROM ledger.tool_calls_in_doubt",
    );
    assert_eq!(doubt, 4);
    let mut admin = connect_to(&db, "postgres");
    assert_eq!(broken_invariants(&mut admin), vec![]);
}
