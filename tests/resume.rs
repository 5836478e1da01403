//! The resume protocol with real sessions: a worker is killed mid-run (after an LLM step, after a
//! tool call's `begin`, after an approval request) and other workers finish the run. Nothing
//! executes twice, finished steps are not redone, the people's decisions are taken once, and the
//! run's feed carries no noise (no `tool_call.replayed` for the run's own calls). Run like
//! tests/sessions.rs (`-- --ignored`).

mod common;

use common::*;
use postgres::Client;
use serde_json::{json, Value};
use std::collections::BTreeMap;

const RUN: &str = "resume-run";

/// Where a worker dies: after its LLM step, after a tool call's `begin` (the request is out),
/// after asking for an approval.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Crash {
    LlmStepDone,
    RequestOut,
    ApprovalAsked,
}

/// How a worker's turn at the run ended.
#[derive(PartialEq, Eq, Debug)]
enum Turn {
    Crashed,
    /// The run waits for a person (an in-doubt call or an approval); the worker let it go.
    Parked(&'static str),
    Finished,
}

/// The world outside the ledger: what each tool and the model were asked to do, counted.
#[derive(Default)]
struct World {
    executed: BTreeMap<String, u32>,
}

impl World {
    fn execute(&mut self, what: &str) -> Value {
        *self.executed.entry(what.to_owned()).or_default() += 1;
        json!({"done": what})
    }
}

fn json_of(c: &mut Client, sql: &str) -> Value {
    let text: String = one(c, &format!("SELECT ({sql})::text"));
    serde_json::from_str(&text).unwrap()
}

/// One worker's turn: claim the run, resume it from what the ledger holds, and drive it as far
/// as it can. This is the loop docs/workers.md documents, with a crash point for the test.
fn work(db: &str, name: &str, world: &mut World, crash: Option<Crash>) -> Turn {
    let mut c = session(db);
    let claimed = c
        .query(
            "SELECT run_id, run_token, status, takeover FROM ledger.claim_run($1, run_id => $2, lease_seconds => 30)",
            &[&name, &RUN],
        )
        .unwrap();
    let row = claimed.first().expect("the run is claimable");
    let token: i64 = row.get(1);
    let status: String = row.get(2);
    if status != "running" {
        c.execute(
            "SELECT ledger.transition_run($1, 'running', run_token => $2)",
            &[&RUN, &token],
        )
        .unwrap();
    }

    // 1. An LLM step, found again by its key; a finished one is not redone.
    let plan: String = c
        .query_one(
            "SELECT status FROM ledger.create_step($1, 'llm', step_key => 'plan', run_token => $2)",
            &[&RUN, &token],
        )
        .unwrap()
        .get(0);
    if plan != "succeeded" {
        world.execute("llm:plan");
        c.batch_execute(&format!(
            "BEGIN;
             SELECT ledger.transition_step(id, 'running', run_token => {token}) FROM ledger.run_steps WHERE run_id = '{RUN}' AND step_key = 'plan';
             SELECT ledger.record_cost('{RUN}', 'tokens', 120, 0.0012, 'USD', usage => '{{\"input_tokens\": 100, \"output_tokens\": 20}}', source_ref => '{RUN}:plan');
             SELECT ledger.transition_step(id, 'succeeded', output_summary => 'look the order up, then refund', run_token => {token}) FROM ledger.run_steps WHERE run_id = '{RUN}' AND step_key = 'plan';
             COMMIT;"
        ))
        .unwrap();
    }
    if crash == Some(Crash::LlmStepDone) {
        return Turn::Crashed;
    }

    // 2. A tool call through the executor protocol.
    let lookup = json_of(
        &mut c,
        &format!("ledger.claim_tool_call('{RUN}', 'crm.lookup', '{{\"order\": 7}}', tool_call_id => 'lookup', timeout_seconds => 5, lease_owner => '{name}', run_token => {token})"),
    );
    match lookup["outcome"].as_str().unwrap() {
        "claimed" => {
            let id = lookup["tool_call"]["id"].as_str().unwrap().to_owned();
            let attempt = lookup["tool_call"]["attempt"].as_i64().unwrap();
            exec(
                &mut c,
                &format!("SELECT ledger.begin_tool_call('{id}', {attempt})"),
            );
            // The request leaves: the side effect happens whatever becomes of the worker.
            let result = world.execute("tool:crm.lookup");
            if crash == Some(Crash::RequestOut) {
                return Turn::Crashed;
            }
            exec(
                &mut c,
                &format!(
                    "SELECT ledger.complete_tool_call('{id}', {attempt}, 'succeeded', '{result}')"
                ),
            );
        }
        "replayed" => {}
        "in_doubt" => {
            // Never retried behind anyone's back: the run waits for a person.
            exec(&mut c, &format!("SELECT ledger.transition_run('{RUN}', 'paused', run_token => {token}); SELECT ledger.release_run('{RUN}', {token})"));
            return Turn::Parked("in_doubt");
        }
        other => panic!("lookup: {other}: {lookup}"),
    }

    // 3. A tool call that needs a person's approval: one call, whatever state it is in.
    let refund = json_of(
        &mut c,
        &format!("ledger.claim_tool_call('{RUN}', 'payments.refund', '{{\"order\": 7, \"amount\": \"12.50\"}}', tool_call_id => 'refund', lease_owner => '{name}', approval => '{{\"title\": \"Refund 12.50 on order 7\"}}', run_token => {token})"),
    );
    match refund["outcome"].as_str().unwrap() {
        "waiting_approval" => {
            if crash == Some(Crash::ApprovalAsked) {
                return Turn::Crashed;
            }
            exec(&mut c, &format!("SELECT ledger.transition_run('{RUN}', 'waiting_approval', run_token => {token}); SELECT ledger.release_run('{RUN}', {token})"));
            return Turn::Parked("waiting_approval");
        }
        "claimed" => {
            let id = refund["tool_call"]["id"].as_str().unwrap().to_owned();
            let attempt = refund["tool_call"]["attempt"].as_i64().unwrap();
            exec(
                &mut c,
                &format!("SELECT ledger.begin_tool_call('{id}', {attempt})"),
            );
            let result = world.execute("tool:payments.refund");
            exec(
                &mut c,
                &format!(
                    "SELECT ledger.complete_tool_call('{id}', {attempt}, 'succeeded', '{result}')"
                ),
            );
        }
        "replayed" => {}
        other => panic!("refund: {other}: {refund}"),
    }

    // 4. The answer, shown to the user, and the end of the run.
    world.execute("llm:answer");
    exec(
        &mut c,
        &format!(
            "BEGIN;
             SELECT ledger.create_step('{RUN}', 'llm', step_key => 'answer', status => 'running', run_token => {token});
             SELECT ledger.record_cost('{RUN}', 'tokens', 80, 0.0008, 'USD', source_ref => '{RUN}:answer');
             SELECT ledger.record_response_event('{RUN}', 'message', '{{\"text\": \"Refunded 12.50.\"}}');
             SELECT ledger.transition_step(id, 'succeeded', run_token => {token}) FROM ledger.run_steps WHERE run_id = '{RUN}' AND step_key = 'answer';
             SELECT ledger.transition_run('{RUN}', 'succeeded', output_summary => 'refunded', run_token => {token});
             COMMIT;"
        ),
    );
    Turn::Finished
}

/// What a crash leaves: the worker's connection gone and, after a while, its leases expired. The
/// test ends the leases now instead of waiting them out.
fn leases_run_out(admin: &mut Client) {
    exec(
        admin,
        "UPDATE ledger.runs SET lease_expires_at = now() - interval '1 second' WHERE lease_expires_at IS NOT NULL;
         UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 second' WHERE lease_expires_at IS NOT NULL;",
    );
}

#[test]
#[ignore]
fn a_run_survives_its_workers_crashing_and_nothing_runs_twice() {
    let db = database("ledger_resume");
    let mut admin = connect_to(&db, "postgres");
    let mut person = session(&db);
    exec(
        &mut person,
        &format!("SELECT ledger.create_run('agent', '{{\"question\": \"refund order 7\"}}', run_id => '{RUN}')"),
    );
    let mut world = World::default();

    // Worker 1 dies after its LLM step; worker 2 takes the run over and does not redo the step,
    // then dies after the lookup's request left.
    assert_eq!(
        work(&db, "w1", &mut world, Some(Crash::LlmStepDone)),
        Turn::Crashed
    );
    leases_run_out(&mut admin);
    assert_eq!(
        work(&db, "w2", &mut world, Some(Crash::RequestOut)),
        Turn::Crashed
    );
    leases_run_out(&mut admin);
    // Worker 3 finds the lookup in doubt and parks the run for a person, executing nothing.
    assert_eq!(work(&db, "w3", &mut world, None), Turn::Parked("in_doubt"));
    let in_doubt: Vec<(String, Option<String>)> = person
        .query(
            "SELECT tool_call_id, lease_owner FROM ledger.tool_calls_in_doubt",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(in_doubt, [("lookup".to_owned(), Some("w2".to_owned()))]);
    exec(
        &mut person,
        "SELECT ledger.resolve_tool_call(id, 'succeeded', '{\"done\": \"crm.lookup\", \"seen_in\": \"crm log\"}', actor => 'ops@acme', note => 'found in the CRM log') FROM ledger.tool_calls_in_doubt",
    );
    // Worker 4 replays the lookup from the ledger, asks for the refund's approval and dies.
    assert_eq!(
        work(&db, "w4", &mut world, Some(Crash::ApprovalAsked)),
        Turn::Crashed
    );
    leases_run_out(&mut admin);
    // Worker 5 finds the approval still pending and parks the run.
    assert_eq!(
        work(&db, "w5", &mut world, None),
        Turn::Parked("waiting_approval")
    );
    let pending: i64 = one(&mut person, "SELECT count(*) FROM ledger.pending_approvals");
    assert_eq!(pending, 1, "one approval, however many workers asked");
    exec(
        &mut person,
        "SELECT ledger.resolve_approval(id, 'approved', actor => 'lead@acme', note => 'ok') FROM ledger.pending_approvals",
    );
    // Worker 6 gets the approved refund as claimed, executes it once and finishes the run.
    assert_eq!(work(&db, "w6", &mut world, None), Turn::Finished);

    let executed: Vec<(&str, u32)> = world
        .executed
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(
        executed,
        [
            ("llm:answer", 1),
            ("llm:plan", 1),
            ("tool:crm.lookup", 1),
            ("tool:payments.refund", 1)
        ],
        "each model call and side effect exactly once"
    );

    // The ledger's record: one step per key, one cost per model call, the run succeeded.
    let steps: String = one(
        &mut person,
        &format!("SELECT string_agg(step_no || ':' || coalesce(step_key, step_type) || ':' || status, ' ' ORDER BY step_no) FROM ledger.run_steps WHERE run_id = '{RUN}'"),
    );
    assert_eq!(
        steps,
        "1:plan:succeeded 2:lookup:succeeded 3:refund:succeeded 4:answer:succeeded"
    );
    let costs: i64 = one(
        &mut person,
        &format!("SELECT count(*) FROM ledger.run_cost_entries WHERE run_id = '{RUN}'"),
    );
    assert_eq!(costs, 2);
    let status: String = one(
        &mut person,
        &format!("SELECT status FROM ledger.runs WHERE id = '{RUN}'"),
    );
    assert_eq!(status, "succeeded");

    // The feed: a run.claimed per claim, no tool_call.replayed for the run's own calls, and the
    // end of the stream marked.
    let feed: Vec<(String, bool)> = person
        .query(
            &format!("SELECT event_type, ends_run FROM ledger.events_since('{RUN}', NULL, 10000)"),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let count = |t: &str| feed.iter().filter(|(e, _)| e == t).count();
    assert_eq!(count("run.claimed"), 6, "{feed:?}");
    assert_eq!(count("tool_call.replayed"), 0, "{feed:?}");
    assert_eq!(count("approval.requested"), 1, "{feed:?}");
    assert_eq!(
        feed.last().map(|(e, end)| (e.as_str(), *end)),
        Some(("run.status", true))
    );
    assert_eq!(feed.iter().filter(|(_, end)| *end).count(), 1);

    // Evidence without any record_audit call: the ledger wrote the tool activity itself.
    let ready = json_of(&mut person, &format!("ledger.replay_ready('{RUN}')"));
    assert_eq!(ready["status"], "pass", "{ready}");
    let audits: i64 = one(
        &mut person,
        &format!("SELECT count(*) FROM ledger.audit_events WHERE run_id = '{RUN}'"),
    );
    assert!(
        audits >= 5,
        "claim, completion, resolution, approval request and decision: {audits}"
    );
    assert!(broken_invariants(&mut admin).is_empty());
}
