//! The designs the benchmark compares, shared by the throughput table (`lifecycle`), the
//! follower's writers (`follower`) and the wait sampler (`waits`): the workload (a tool call's
//! arguments and its 2 KB result), what each design's clients run for one lifecycle (the floor,
//! the ledger's functions, the same lifecycle application-side with or without the run feed),
//! the table of designs with their `ledger.notify` modes, and the writing sessions the sampler
//! watches.

use postgres::types::ToSql;
use postgres::{Client, Statement, Transaction};
use serde_json::{json, Value};

use ledger_model::feed::insert_statement;
use ledger_model::hash::{ChannelKey, CHANNEL_KEY_BYTES};
use ledger_model::{json as cjson, redaction};

pub const TX_PER_LIFECYCLE: f64 = 3.0;
pub const TENANT: &str = "bench";
pub const WORKSPACE: &str = "lifecycle";
const TOOL: &str = "crm.lookup_order";
const LEASE_SECONDS: i32 = 60;

/// Tool arguments with something to redact: a credential under a sensitive key and in a value.
pub fn arguments() -> Value {
    json!({
        "order_id": 1042,
        "customer": {"email": "ada@example.com", "apiKey": "k-93c1f0e2a7"},
        "headers": {"Authorization": "Bearer abcdefghijklmnopqrstuvwxyz"},
        "query": "Where is my order? It was due on Monday.",
        "max_tokens": 256
    })
}

/// A tool result whose canonical JSON is about 2 KB (kept inline: the limit is 8 KB).
pub fn result_2kb() -> Value {
    let lines: Vec<Value> = (0..16)
        .map(|i| json!({"sku": format!("SKU-{i:05}"), "qty": i + 1, "note": "x".repeat(80)}))
        .collect();
    let v = json!({"status": "shipped", "eta": "tomorrow", "lines": lines});
    let n = cjson::canonical(&v).len();
    assert!((1900..2300).contains(&n), "result is {n} bytes, not ~2 KB");
    v
}

pub fn app_schema(c: &mut Client) {
    // Same columns, defaults, checks and indexes as the ledger's tables (LIKE ... INCLUDING ALL),
    // the same scoped foreign keys, no RLS and no functions: the application enforces the rules.
    c.batch_execute(
        "DROP SCHEMA IF EXISTS app CASCADE;
         CREATE SCHEMA app;
         CREATE TABLE app.runs (LIKE ledger.runs INCLUDING ALL);
         CREATE TABLE app.run_steps (LIKE ledger.run_steps INCLUDING ALL,
             FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES app.runs);
         CREATE TABLE app.run_step_tool_calls (LIKE ledger.run_step_tool_calls INCLUDING ALL,
             FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES app.runs,
             FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES app.run_steps);
         CREATE TABLE app.run_cost_entries (LIKE ledger.run_cost_entries INCLUDING ALL,
             FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES app.runs,
             FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES app.run_steps);
         CREATE TABLE app.outbox (LIKE ledger.outbox INCLUDING ALL,
             FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES app.runs);
         CREATE TABLE app.run_events (LIKE ledger.run_events INCLUDING ALL,
             FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES app.runs,
             FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES app.run_steps);
         DROP TABLE IF EXISTS public.bench_floor;
         CREATE TABLE public.bench_floor (id bigserial PRIMARY KEY, client_id int NOT NULL,
             payload text NOT NULL, created_at timestamptz NOT NULL DEFAULT now());",
    )
    .expect("creating the application-side tables");
}

struct Floor {
    insert: Statement,
    client: i32,
    payload: String,
}

impl Floor {
    fn new(c: &mut Client, client: i32, notify: bool) -> Floor {
        let sql = if notify {
            "WITH i AS (INSERT INTO public.bench_floor (client_id, payload) VALUES ($1, $2) RETURNING id)
             SELECT pg_catalog.pg_notify('bench_floor_' || $1, i.id::text) FROM i"
        } else {
            "INSERT INTO public.bench_floor (client_id, payload) VALUES ($1, $2)"
        };
        Floor {
            insert: c.prepare(sql).expect("prepare floor"),
            client,
            payload: "p".repeat(100),
        }
    }

    fn lifecycle(&mut self, c: &mut Client) {
        for _ in 0..TX_PER_LIFECYCLE as usize {
            c.execute(&self.insert, &[&self.client, &self.payload])
                .expect("floor insert");
        }
    }
}

pub struct Ledger {
    run_id: String,
    n: u64,
    claim: Statement,
    begin: Statement,
    complete: Statement,
    cost: Statement,
}

impl Ledger {
    pub fn new(c: &mut Client, run_id: String, budgets: bool) -> Ledger {
        c.batch_execute(&format!(
            "SELECT ledger.set_scope('{TENANT}', '{WORKSPACE}')"
        ))
        .expect("set_scope");
        c.execute(
            "SELECT ledger.create_run('agent', run_id => $1)",
            &[&run_id],
        )
        .expect("create_run");
        c.execute("SELECT ledger.transition_run($1, 'running')", &[&run_id])
            .expect("transition_run");
        if budgets {
            c.execute(
                "SELECT ledger.set_budget(u, 1e15, 'run', run_id => $1, warn_ratio => NULL)
                   FROM unnest(ARRAY['tool_calls', 'USD']) u",
                &[&run_id],
            )
            .expect("set_budget");
        }
        let claim = c
            .prepare(&format!(
                "SELECT r->>'outcome', r->'tool_call'->>'id', (r->'tool_call'->>'attempt')::bigint,
                        r->'tool_call'->>'step_id'
                   FROM ledger.claim_tool_call($1, '{TOOL}', $2, tool_call_id => $3) AS r"
            ))
            .expect("prepare claim");
        let begin = c
            .prepare("SELECT ledger.begin_tool_call($1, $2)")
            .expect("prepare begin");
        let complete = c
            .prepare("SELECT ledger.complete_tool_call($1, $2, 'succeeded', $3)")
            .expect("prepare complete");
        let cost = c
            .prepare(&format!(
                "SELECT id FROM ledger.record_cost($1, 'requests', 1, 0.0004, 'USD', step_id => $2,
                    usage => '{{\"latency_ms\": 12, \"request_count\": 1}}', tool_ref => '{TOOL}')"
            ))
            .expect("prepare record_cost");
        Ledger {
            run_id,
            n: 0,
            claim,
            begin,
            complete,
            cost,
        }
    }

    pub fn lifecycle(&mut self, c: &mut Client, args: &Value, result: &Value) {
        self.n += 1;
        let call_id = format!("call-{}", self.n);
        let row = c
            .query_one(&self.claim, &[&self.run_id, args, &call_id])
            .expect("claim_tool_call");
        let outcome: &str = row.get(0);
        assert_eq!(outcome, "claimed", "claim of a new key");
        let id: String = row.get(1);
        let attempt: i64 = row.get(2);
        let step_id: String = row.get(3);
        c.execute(&self.begin, &[&id, &attempt])
            .expect("begin_tool_call");
        let mut tx = c.transaction().expect("BEGIN");
        tx.execute(&self.complete, &[&id, &attempt, result])
            .expect("complete_tool_call");
        tx.execute(&self.cost, &[&self.run_id, &step_id])
            .expect("record_cost");
        tx.commit().expect("COMMIT");
    }
}

/// The ledger's run feed written application-side, as a careful client would: per transaction
/// one `last_seq` bump under the run's row lock and one INSERT of its events with a NOTIFY each
/// (the ledger's own statement). The plain application-side design keeps no feed; this prices it.
struct Feed {
    bump: Statement,
    /// The INSERT of 2 and of 3 events.
    insert: [Statement; 2],
    channel: String,
}

impl Feed {
    fn new(c: &mut Client, run_id: &str) -> Feed {
        let mut p = |sql: &str| c.prepare(sql).expect("prepare feed");
        Feed {
            bump: p(&format!(
                "UPDATE app.runs SET last_seq = last_seq + $4 WHERE {SCOPE} AND id = $3 \
                 RETURNING last_seq"
            )),
            insert: [
                p(&insert_statement(2, true).replace("ledger.run_events", "app.run_events")),
                p(&insert_statement(3, true).replace("ledger.run_events", "app.run_events")),
            ],
            // Keyed as the ledger keys its channels, with the application's own secret.
            channel: ChannelKey::new(&[0x5a; CHANNEL_KEY_BYTES])
                .expect("a key of the right length")
                .run_channel(TENANT, WORKSPACE, run_id),
        }
    }

    /// Moves the run's `last_seq` on by `k` (locking the run); returns the first new seq.
    fn bump(&self, tx: &mut Transaction, run_id: &str, k: i64) -> i64 {
        let row = tx
            .query_one(&self.bump, &[&TENANT, &WORKSPACE, &run_id, &k])
            .expect("bump last_seq");
        row.get::<_, i64>(0) - k + 1
    }

    /// Writes the transaction's events from seq `first` on, all of one step.
    fn write(
        &self,
        tx: &mut Transaction,
        run_id: &str,
        first: i64,
        step_id: &str,
        events: &[(&str, Value)],
    ) {
        let rows: Vec<(String, i64, String)> = events
            .iter()
            .enumerate()
            .map(|(i, (event_type, _))| {
                let seq = first + i as i64;
                let id = format!("evt_{}", ulid::Ulid::new());
                let note =
                    json!({"run_id": run_id, "seq": seq, "event_id": id, "event_type": event_type})
                        .to_string();
                (id, seq, note)
            })
            .collect();
        let mut args: Vec<&(dyn ToSql + Sync)> = vec![&TENANT, &WORKSPACE, &run_id, &self.channel];
        for ((id, seq, note), (event_type, payload)) in rows.iter().zip(events) {
            args.extend([
                id as &(dyn ToSql + Sync),
                seq,
                event_type,
                &step_id,
                payload,
                note,
            ]);
        }
        tx.execute(&self.insert[events.len() - 2], &args)
            .expect("insert events");
    }
}

/// An application-side tool executor (claim, mark_running, complete) and the gateway's step
/// update and cost row, as client code over plain tables; with `feed`, also the ledger's feed.
struct App {
    run_id: String,
    n: u64,
    feed: Option<Feed>,
    rules: redaction::Rules,
    run_in_scope: Statement,
    find_call: Statement,
    insert_step: Statement,
    step_status: Statement,
    insert_call: Statement,
    lock_call: Statement,
    mark_running: Statement,
    lock_step: Statement,
    finish_step: Statement,
    insert_cost: Statement,
    insert_outbox: Statement,
    complete_call: Statement,
}

const SCOPE: &str = "tenant_id = $1 AND workspace_id = $2";

impl App {
    fn new(c: &mut Client, run_id: String, feed: bool) -> App {
        c.execute(
            "INSERT INTO app.runs (tenant_id, workspace_id, id, mode, kind, subject_kind,
                 root_run_id, status, started_at)
             VALUES ($1, $2, $3, 'agent', 'agent', 'agent', $3, 'running', now())",
            &[&TENANT, &WORKSPACE, &run_id],
        )
        .expect("app run");
        let feed = feed.then(|| Feed::new(c, &run_id));
        let mut p = |sql: &str| {
            c.prepare(sql)
                .unwrap_or_else(|e| panic!("prepare {sql}: {e:?}"))
        };
        App {
            run_id,
            n: 0,
            feed,
            rules: redaction::Rules::default(),
            run_in_scope: p(&format!("SELECT 1 FROM app.runs WHERE {SCOPE} AND id = $3")),
            find_call: p(&format!(
                "SELECT id, status FROM app.run_step_tool_calls
                  WHERE {SCOPE} AND run_id = $3 AND tool_call_id = $4 FOR UPDATE"
            )),
            insert_step: p(
                "INSERT INTO app.run_steps (tenant_id, workspace_id, id, run_id,
                                step_type, status, input_summary, step_no)
                            VALUES ($1, $2, $3, $4, 'tool', 'queued', $5, $6)",
            ),
            step_status: p(&format!(
                "UPDATE app.run_steps SET status = $4, started_at = coalesce(started_at, now()),
                        updated_at = now()
                  WHERE {SCOPE} AND id = $3"
            )),
            insert_call: p(
                "INSERT INTO app.run_step_tool_calls (tenant_id, workspace_id, id,
                                run_id, step_id, tool_call_id, tool_ref, idempotency_key,
                                request_hash, arguments, status, attempt, lease_owner,
                                lease_seconds, lease_expires_at)
                            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'claimed', 1, $11,
                                $12, now() + $12::integer * interval '1 second')",
            ),
            lock_call: p(&format!(
                "SELECT status, lease_owner, lease_expires_at > now(), step_id
                   FROM app.run_step_tool_calls WHERE {SCOPE} AND id = $3 FOR UPDATE"
            )),
            mark_running: p(&format!(
                "UPDATE app.run_step_tool_calls SET status = 'running', outbound_started_at = now(),
                        lease_expires_at = now() + lease_seconds * interval '1 second',
                        updated_at = now()
                  WHERE {SCOPE} AND id = $3"
            )),
            lock_step: p(&format!(
                "SELECT status, metrics FROM app.run_steps WHERE {SCOPE} AND id = $3 FOR UPDATE"
            )),
            finish_step: p(&format!(
                "UPDATE app.run_steps SET status = $4, output_summary = $5,
                        metrics = metrics || $6, ended_at = now(), updated_at = now()
                  WHERE {SCOPE} AND id = $3"
            )),
            insert_cost: p(&format!(
                "INSERT INTO app.run_cost_entries (tenant_id, workspace_id, id, run_id, step_id,
                     billing_basis, billed_quantity, amount, currency, usage, tool_ref)
                 VALUES ($1, $2, $3, $4, $5, 'requests', 1, 0.0004, 'USD', $6, '{TOOL}')"
            )),
            insert_outbox: p(
                "INSERT INTO app.outbox (tenant_id, workspace_id, id, event_type,
                                  run_id, payload)
                              VALUES ($1, $2, $3, 'cost.recorded', $4, $5)",
            ),
            complete_call: p(&format!(
                "UPDATE app.run_step_tool_calls SET status = 'succeeded', result = $4,
                        result_size_bytes = $5, lease_expires_at = NULL, completed_at = now(),
                        updated_at = now()
                  WHERE {SCOPE} AND id = $3"
            )),
        }
    }

    fn lifecycle(&mut self, c: &mut Client, args: &Value, result: &Value) {
        self.n += 1;
        let (t, w) = (TENANT, WORKSPACE);
        let call_id = format!("call-{}", self.n);
        let owner = format!("tool:{}", self.run_id);

        // claim
        let request_hash = cjson::request_hash(args);
        let stored_args = redaction::summarize_arguments(&self.rules, args.clone(), &request_hash);
        let mut tx = c.transaction().expect("BEGIN");
        let found = tx
            .query(&self.run_in_scope, &[&t, &w, &self.run_id])
            .expect("run in scope");
        assert_eq!(found.len(), 1, "Run scope mismatch");
        let existing = tx
            .query(&self.find_call, &[&t, &w, &self.run_id, &call_id])
            .expect("find call");
        assert!(existing.is_empty(), "a new key has no record");
        let step_id = format!("step_{}", ulid::Ulid::new());
        // With the feed, the step's number is the seq of its step.created event, as in the ledger.
        let first = self.feed.as_ref().map(|f| f.bump(&mut tx, &self.run_id, 3));
        let step_no = first.unwrap_or(self.n as i64);
        let summary = format!("tool={TOOL}");
        tx.execute(
            &self.insert_step,
            &[&t, &w, &step_id, &self.run_id, &summary, &step_no],
        )
        .expect("insert step");
        tx.execute(&self.step_status, &[&t, &w, &step_id, &"preparing"])
            .expect("step preparing");
        let id = format!("tc_{}", ulid::Ulid::new());
        let key = format!("tool:{}:{call_id}", self.run_id);
        tx.execute(
            &self.insert_call,
            &[
                &t,
                &w,
                &id,
                &self.run_id,
                &step_id,
                &call_id,
                &TOOL,
                &key,
                &request_hash,
                &stored_args,
                &owner,
                &LEASE_SECONDS,
            ],
        )
        .expect("insert call");
        if let (Some(f), Some(first)) = (&self.feed, first) {
            let step = json!({"step_id": step_id, "step_type": "tool", "step_key": call_id,
                "status": "queued", "node_id": null});
            let preparing = json!({"step_id": step_id, "from": "queued", "to": "preparing",
                "error_code": null});
            let claimed = json!({"tool_call_record_id": id, "tool_call_id": call_id,
                "tool_ref": TOOL, "step_id": step_id, "attempt": 1, "lease_owner": owner,
                "idempotency_key": key});
            let events = [
                ("step.created", step),
                ("step.status", preparing),
                ("tool_call.claimed", claimed),
            ];
            f.write(&mut tx, &self.run_id, first, &step_id, &events);
        }
        tx.commit().expect("COMMIT claim");

        // mark_running
        let mut tx = c.transaction().expect("BEGIN");
        let row = tx
            .query_one(&self.lock_call, &[&t, &w, &id])
            .expect("lock call");
        let (status, lease_owner): (&str, &str) = (row.get(0), row.get(1));
        assert!(status == "claimed" && lease_owner == owner, "cannot start");
        let first = self.feed.as_ref().map(|f| f.bump(&mut tx, &self.run_id, 2));
        tx.execute(&self.mark_running, &[&t, &w, &id])
            .expect("mark running");
        let step = tx
            .query_one(&self.lock_step, &[&t, &w, &step_id])
            .expect("lock step");
        assert_eq!(step.get::<_, &str>(0), "preparing");
        tx.execute(&self.step_status, &[&t, &w, &step_id, &"running"])
            .expect("step running");
        if let (Some(f), Some(first)) = (&self.feed, first) {
            let running = json!({"step_id": step_id, "from": "preparing", "to": "running",
                "error_code": null});
            let started = json!({"tool_call_record_id": id, "tool_call_id": call_id,
                "tool_ref": TOOL, "step_id": step_id, "attempt": 1, "idempotency_key": key});
            let events = [("step.status", running), ("tool_call.running", started)];
            f.write(&mut tx, &self.run_id, first, &step_id, &events);
        }
        tx.commit().expect("COMMIT running");

        // complete, with the gateway's step update, cost row and outbox row
        let payload = json!({"result": result, "metadata": {}});
        let encoded = cjson::canonical(&payload);
        assert!(encoded.len() <= 8192, "inline result");
        let output_summary: String = cjson::canonical(result).chars().take(8192).collect();
        let metrics = json!({"latency_ms": 12, "success": true, "tool_ref": TOOL,
            "tool_call": {"tool_call_id": call_id, "tool_ref": TOOL, "attempt_count": 1, "replayed": false}});
        let cost_id = format!("cost_{}", ulid::Ulid::new());
        let outbox_id = format!("obx_{}", ulid::Ulid::new());
        let usage = json!({"latency_ms": 12, "request_count": 1});
        let outbox_payload = json!({"cost_id": cost_id, "run_id": self.run_id, "step_id": step_id,
            "amount": "0.0004", "currency": "USD", "billing_basis": "requests"});
        let mut tx = c.transaction().expect("BEGIN");
        let row = tx
            .query_one(&self.lock_call, &[&t, &w, &id])
            .expect("lock call");
        let (status, lease_live): (&str, bool) = (row.get(0), row.get(2));
        assert!(status == "running" && lease_live, "cannot complete");
        let first = self.feed.as_ref().map(|f| f.bump(&mut tx, &self.run_id, 3));
        let step = tx
            .query_one(&self.lock_step, &[&t, &w, &step_id])
            .expect("lock step");
        assert_eq!(step.get::<_, &str>(0), "running");
        tx.execute(
            &self.finish_step,
            &[&t, &w, &step_id, &"succeeded", &output_summary, &metrics],
        )
        .expect("finish step");
        tx.execute(
            &self.insert_cost,
            &[&t, &w, &cost_id, &self.run_id, &step_id, &usage],
        )
        .expect("insert cost");
        tx.execute(
            &self.insert_outbox,
            &[&t, &w, &outbox_id, &self.run_id, &outbox_payload],
        )
        .expect("insert outbox");
        let size = encoded.len() as i64;
        tx.execute(&self.complete_call, &[&t, &w, &id, &payload, &size])
            .expect("complete call");
        if let (Some(f), Some(first)) = (&self.feed, first) {
            let succeeded = json!({"step_id": step_id, "from": "running", "to": "succeeded",
                "error_code": null});
            let completed = json!({"tool_call_record_id": id, "tool_call_id": call_id,
                "tool_ref": TOOL, "step_id": step_id, "attempt": 1, "idempotency_key": key,
                "status": "succeeded", "result_artifact_id": null});
            let events = [
                ("step.status", succeeded),
                ("tool_call.completed", completed),
                ("cost.recorded", outbox_payload),
            ];
            f.write(&mut tx, &self.run_id, first, &step_id, &events);
        }
        tx.commit().expect("COMMIT complete");
    }
}

/// What a design's clients run.
#[derive(Clone, Copy, PartialEq)]
pub enum Kind {
    Floor,
    NotifyingFloor,
    Ledger,
    App,
    AppFeed,
}

/// A design of the throughput table: what its clients run, and the `ledger.notify` their
/// sessions set before its runs (None: the server's default, `RESET ledger.notify`). A notify
/// mode is a per-design session setting, so another mode is one more row here.
pub struct Design {
    pub name: &'static str,
    pub kind: Kind,
    pub notify: Option<&'static str>,
    /// The run has budgets of tool calls and of money that never run out: every claim decides
    /// and counts under the budget's lock, every cost is counted.
    pub budgets: bool,
}

/// The designs, in the order of the tables' columns.
pub const DESIGNS: [Design; 8] = [
    Design {
        name: "floor",
        kind: Kind::Floor,
        notify: None,
        budgets: false,
    },
    Design {
        name: "notifying floor",
        kind: Kind::NotifyingFloor,
        notify: None,
        budgets: false,
    },
    Design {
        name: "ledger",
        kind: Kind::Ledger,
        notify: None,
        budgets: false,
    },
    Design {
        name: "ledger, notify inline",
        kind: Kind::Ledger,
        notify: Some("inline"),
        budgets: false,
    },
    Design {
        name: "ledger, notify off",
        kind: Kind::Ledger,
        notify: Some("off"),
        budgets: false,
    },
    Design {
        name: "ledger, budgets",
        kind: Kind::Ledger,
        notify: None,
        budgets: true,
    },
    Design {
        name: "app-side",
        kind: Kind::App,
        notify: None,
        budgets: false,
    },
    Design {
        name: "app-side + feed",
        kind: Kind::AppFeed,
        notify: None,
        budgets: false,
    },
];

/// The statement that gives a session design `d`'s notify mode.
pub fn notify_setting(d: &Design) -> String {
    match d.notify {
        Some(mode) => format!("SET ledger.notify = {mode}"),
        None => "RESET ledger.notify".into(),
    }
}

/// The application_name of the benchmark's writing sessions: the wait sampler watches these.
pub const WRITER: &str = "ledger-bench-writer";

/// A client session of the benchmark that writes, named so that the wait sampler finds it.
pub fn writer(conn: &str) -> Client {
    let mut c = Client::connect(conn, postgres::NoTls).expect("connect");
    c.batch_execute(&format!("SET application_name = '{WRITER}'"))
        .expect("application_name");
    c
}

/// One client's state for every design.
pub struct Clients {
    floor: Floor,
    notifying: Floor,
    /// One run per ledger design, so that each design's rows are its own.
    ledgers: Vec<Option<Ledger>>,
    app: App,
    app_feed: App,
}

impl Clients {
    pub fn new(c: &mut Client, i: usize, run_id: &str) -> Clients {
        Clients {
            floor: Floor::new(c, i as i32, false),
            notifying: Floor::new(c, i as i32, true),
            ledgers: DESIGNS
                .iter()
                .enumerate()
                .map(|(d, design)| {
                    (design.kind == Kind::Ledger)
                        .then(|| Ledger::new(c, format!("{run_id}-d{d}"), design.budgets))
                })
                .collect(),
            app: App::new(c, run_id.to_owned(), false),
            app_feed: App::new(c, format!("{run_id}-feed"), true),
        }
    }

    pub fn lifecycle(&mut self, d: usize, c: &mut Client, args: &Value, result: &Value) {
        match DESIGNS[d].kind {
            Kind::Floor => self.floor.lifecycle(c),
            Kind::NotifyingFloor => self.notifying.lifecycle(c),
            Kind::Ledger => self.ledgers[d]
                .as_mut()
                .expect("a ledger design's run")
                .lifecycle(c, args, result),
            Kind::App => self.app.lifecycle(c, args, result),
            Kind::AppFeed => self.app_feed.lifecycle(c, args, result),
        }
    }
}
