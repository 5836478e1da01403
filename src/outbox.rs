//! The transactional outbox. Its write side: every fact a consumer must hear of is written as an
//! outbox row in the caller's transaction (`enqueue`). Its consumer API: claim a batch under a
//! lease, ack, nack with backoff, and replay a failed event. Delivery is at least once: a lease
//! that expires is re-taken by the next claim, so consumers deduplicate on the event id.
//!
//! The rules (bounds, backoff, when an event fails) are in `ledger_model::outbox`; this is SPI.

use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::jsonb::Jsonb;
use crate::notifier;
use crate::redaction::free_text;
use crate::scope::{self, Scope};
use ledger_model::args::required_id;
use ledger_model::events;
use ledger_model::ids;
use ledger_model::outbox::{self as rules, AfterNack};
use ledger_model::run_leases;
use pgrx::prelude::*;

pub(crate) type Event = pgrx::composite_type!('static, "ledger.outbox_event");

/// The columns of `ledger.outbox_event`, from an outbox row `o`.
const EVENT: &str =
    "(o.tenant_id, o.workspace_id, o.id, o.event_type, o.run_id, o.task_id, o.subject, \
      o.payload, o.status, o.attempt_count, o.replay_count, o.available_at, o.lease_expires_at, \
      o.error_message, o.occurred_at, o.processed_at)::ledger.outbox_event";

/// Writes an outbox row in the caller's transaction and wakes `ledger_outbox`'s listeners at
/// commit with its id. `subject` names the fact (`run:<id>`, `tool_call:<id>`).
pub fn enqueue(
    scope: &Scope,
    event: &events::Event,
    run_id: Option<&str>,
    task_id: Option<&str>,
    subject: &str,
) -> Result<String> {
    let id = ids::new_id("obx");
    db::execute(
        include_str!("../sql/queries/enqueue_outbox.sql"),
        &scope.args([
            id.as_str().into(),
            event.event_type().into(),
            run_id.into(),
            task_id.into(),
            subject.into(),
            Jsonb::from(&event.payload()).into(),
        ]),
    )?;
    wakeup(&id);
    Ok(id)
}

/// Tells `ledger_outbox`'s listeners (at commit) that the event is due, as `ledger.notify` says.
pub fn wakeup(id: &str) {
    match notifier::mode() {
        notifier::Mode::Off => {}
        notifier::Mode::Inline => notifier::notify("ledger_outbox", id),
        notifier::Mode::Worker => notifier::outbox_news(id),
    }
}

fn not_found(id: &str) -> LedgerError {
    LedgerError::not_found(Code::OutboxEventNotFound, "outbox event", id)
}

/// The events `ids` as `ledger.outbox_event`, in claim order.
fn events(scope: &Scope, ids: Vec<String>) -> Result<Vec<Event>> {
    db::select(
        &format!(
            "SELECT {EVENT} FROM ledger.outbox o WHERE tenant_id = $1 AND workspace_id = $2 \
               AND id = ANY($3) ORDER BY available_at, id"
        ),
        &scope.args([ids.into()]),
        |r| db::req::<Event>(r, 1),
    )
}

/// The columns nack and replay decide on.
struct Held {
    event_type: String,
    status: String,
    lease_owner: Option<String>,
    attempt_count: i32,
    replay_count: i32,
}

/// The event `id`, locked (P0002 `OUTBOX_EVENT_NOT_FOUND`).
fn locked(scope: &Scope, id: &str) -> Result<Held> {
    db::write_one(
        "SELECT event_type, status, lease_owner, attempt_count, replay_count FROM ledger.outbox \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 FOR UPDATE",
        &scope.args([id.into()]),
        |r| {
            Ok(Held {
                event_type: db::req(r, 1)?,
                status: db::req(r, 2)?,
                lease_owner: db::opt(r, 3)?,
                attempt_count: db::req(r, 4)?,
                replay_count: db::req(r, 5)?,
            })
        },
    )?
    .ok_or_else(|| not_found(id))
}

fn lease_owner_arg(lease_owner: Option<&str>) -> Result<&str> {
    required_id("lease_owner", lease_owner)
}

pub(crate) fn event_id_arg(event_id: Option<&str>) -> Result<String> {
    let id = required_id("event_id", event_id)?;
    // An untyped '{a,b}' literal resolves to the single-id variant; the ledger's ids never
    // start with a brace, so say what happened instead of acking nothing.
    if id.starts_with('{') {
        return Err(LedgerError::new(
            Code::IdInvalid,
            "event_id looks like an array literal: pass ARRAY[...] or cast it to text[]",
        )
        .with("argument", "event_id"));
    }
    Ok(id.to_owned())
}

/// The ids of an `event_ids` array: none NULL, each a valid id, no more than a claim returns.
fn event_ids_arg(event_ids: Option<Vec<Option<String>>>) -> Result<Vec<String>> {
    let event_ids = event_ids.ok_or_else(|| LedgerError::required("event_ids"))?;
    if event_ids.len() > rules::MAX_CLAIM_EVENTS as usize {
        return Err(LedgerError::new(
            Code::LimitInvalid,
            format!("event_ids may hold at most {} ids", rules::MAX_CLAIM_EVENTS),
        )
        .with("argument", "event_ids")
        .with("value", event_ids.len()));
    }
    event_ids
        .into_iter()
        .map(|id| {
            let id = id.ok_or_else(|| LedgerError::required("event_ids"))?;
            ids::validate("event_ids", &id)?;
            Ok(id)
        })
        .collect()
}

/// Claims up to `max_events` due events of the scope for `lease_owner`: pending ones whose
/// `available_at` has come and processing ones whose lease expired, oldest first. Each becomes
/// processing under a lease of `lease_seconds` and counts an attempt. Rows another claimer holds
/// are skipped, never waited for. An expired lease on an event's last attempt fails the event
/// instead of delivering it again, so a consumer that crashes on it cannot loop forever. With
/// `any_scope` (members of ledger_operator only), the oldest due events of every scope.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn claim_outbox_events(
    lease_owner: Option<&str>,
    max_events: default!(Option<i32>, 50),
    lease_seconds: default!(Option<i32>, 60),
    any_scope: default!(Option<bool>, false),
) -> std::result::Result<
    SetOfIterator<'static, pgrx::composite_type!('static, "ledger.outbox_event")>,
    SqlError,
> {
    let lease_owner = lease_owner_arg(lease_owner)?;
    let limit =
        rules::claim_events(max_events.ok_or_else(|| LedgerError::required("max_events"))?)?;
    let lease =
        rules::lease_seconds(lease_seconds.ok_or_else(|| LedgerError::required("lease_seconds"))?)?;
    if !any_scope.unwrap_or(false) {
        let scope = scope::current()?;
        // Locks the batch; the updates below then never wait. A processing event was due when
        // it was claimed, so `available_at <= now` holds for both kinds: outbox_claim_idx is
        // scanned in claim order up to now and stops at the limit.
        let due = db::write_one(
            include_str!("../sql/queries/claim_due_outbox_events.sql"),
            &scope.args([i64::from(limit).into()]),
            batch,
        )?;
        return Ok(SetOfIterator::new(lease_batch(
            &scope,
            due,
            lease_owner,
            lease,
        )?));
    }
    run_leases::check_any_scope(scope::is_operator()?, None)?;
    // Found and locked across the caller's scopes (its granted ones, when its login role is
    // bound), then leased in each one's scope, which is taken back after.
    let (tenants, workspaces, ids) = db::write_one(
        "SELECT array_agg(tenant_id), array_agg(workspace_id), array_agg(id) \
           FROM ledger_dispatch.due_outbox_events($1)",
        &[limit.into()],
        |r| {
            Ok((
                db::opt::<Vec<String>>(r, 1)?.unwrap_or_default(),
                db::opt::<Vec<String>>(r, 2)?.unwrap_or_default(),
                db::opt::<Vec<String>>(r, 3)?.unwrap_or_default(),
            ))
        },
    )?
    .ok_or_else(|| LedgerError::internal("an aggregate returned no row"))?;
    let mut by_scope: Vec<(Scope, Vec<String>)> = Vec::new();
    for ((tenant, workspace), id) in tenants.into_iter().zip(workspaces).zip(ids) {
        match by_scope
            .iter_mut()
            .find(|(s, _)| s.tenant == tenant && s.workspace == workspace)
        {
            Some((_, listed)) => listed.push(id),
            None => by_scope.push((Scope { tenant, workspace }, vec![id])),
        }
    }
    let mut claimed = Vec::new();
    for (scope, listed) in by_scope {
        claimed.extend(scope::within(&scope, || {
            let due = db::select_one(
                "SELECT array_agg(id), array_agg(attempt_count), array_agg(replay_count) \
                   FROM ledger.outbox WHERE tenant_id = $1 AND workspace_id = $2 AND id = ANY($3)",
                &scope.args([listed.into()]),
                batch,
            )?;
            lease_batch(&scope, due, lease_owner, lease)
        })?);
    }
    Ok(SetOfIterator::new(claimed))
}

/// A locked batch of due events: their ids, attempts and replays.
type Batch = (Vec<String>, Vec<i32>, Vec<i32>);

fn batch(r: &db::Row) -> Result<Batch> {
    Ok((
        db::opt::<Vec<String>>(r, 1)?.unwrap_or_default(),
        db::opt::<Vec<i32>>(r, 2)?.unwrap_or_default(),
        db::opt::<Vec<i32>>(r, 3)?.unwrap_or_default(),
    ))
}

/// Fails the batch's exhausted events and leases the others to `lease_owner`; returns those.
fn lease_batch(
    scope: &Scope,
    due: Option<Batch>,
    lease_owner: &str,
    lease: i32,
) -> Result<Vec<Event>> {
    let (due, attempts, replays) =
        due.ok_or_else(|| LedgerError::internal("an aggregate returned no row"))?;
    let (mut spent, mut fresh) = (Vec::new(), Vec::new());
    for (id, (attempt, replay)) in due.into_iter().zip(attempts.into_iter().zip(replays)) {
        if rules::exhausted(attempt, replay) {
            spent.push(id);
        } else {
            fresh.push(id);
        }
    }

    if !spent.is_empty() {
        db::execute(
            include_str!("../sql/queries/fail_exhausted_outbox_events.sql"),
            &scope.args([spent.into(), db::clock()?.into()]),
        )?;
    }
    if fresh.is_empty() {
        return Ok(Vec::new());
    }
    db::execute(
        include_str!("../sql/queries/lease_outbox_events.sql"),
        &scope.args([
            fresh.clone().into(),
            lease_owner.into(),
            db::clock_plus(lease.into())?.into(),
        ]),
    )?;
    events(scope, fresh)
}

/// Marks the events `lease_owner` holds as done; returns how many. Ids it does not hold (an
/// expired lease re-taken by another claimer, an event already done) are ignored: delivery is
/// at least once, and the other claimer acks its own copy.
fn ack(lease_owner: Option<&str>, ids: Result<Vec<String>>) -> Result<i32> {
    let scope = scope::current()?;
    let lease_owner = lease_owner_arg(lease_owner)?;
    let ids = ids?;
    let acked = db::write_one(
        include_str!("../sql/queries/ack_outbox_events.sql"),
        &scope.args([ids.into(), lease_owner.into(), db::clock()?.into()]),
        |r| db::req::<i32>(r, 1),
    )?;
    Ok(acked.unwrap_or(0))
}

#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn ack_outbox_events(
    lease_owner: Option<&str>,
    event_ids: Option<Vec<Option<String>>>,
) -> std::result::Result<i32, SqlError> {
    Ok(ack(lease_owner, event_ids_arg(event_ids))?)
}

#[pg_extern(name = "ack_outbox_events", volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn ack_outbox_event(
    lease_owner: Option<&str>,
    event_id: Option<&str>,
) -> std::result::Result<i32, SqlError> {
    Ok(ack(lease_owner, event_id_arg(event_id).map(|id| vec![id]))?)
}

/// Reports a failed attempt of events `lease_owner` holds: each goes back to pending after a
/// backoff of min(300, 2^(n-1)) seconds for its n-th attempt since its last replay, or to
/// failed after the 64th. `error_message` is kept, cut to 8192 characters. An event the caller
/// does not hold fails the call (55000 `OUTBOX_NOT_LEASED`) and nothing is changed.
fn nack(
    lease_owner: Option<&str>,
    ids: Result<Vec<String>>,
    error_message: Option<&str>,
) -> Result<Vec<Event>> {
    let scope = scope::current()?;
    let lease_owner = lease_owner_arg(lease_owner)?;
    let mut ids = ids?;
    // An empty message is still a failure report (many exceptions have no text).
    let error_message = free_text(Some(
        error_message.ok_or_else(|| LedgerError::required("error_message"))?,
    ))
    .unwrap_or_default();
    // One lock order for every caller, so two overlapping nacks cannot deadlock.
    ids.sort_unstable();
    ids.dedup();
    for id in &ids {
        let held = locked(&scope, id)?;
        rules::check_held(id, lease_owner, &held.status, held.lease_owner.as_deref())?;
        let (status, delay) = match rules::after_nack(held.attempt_count, held.replay_count) {
            AfterNack::Retry { delay_seconds } => ("pending", delay_seconds),
            AfterNack::Fail => ("failed", 0),
        };
        db::execute(
            include_str!("../sql/queries/nack_outbox_event.sql"),
            &scope.args([
                id.as_str().into(),
                status.into(),
                error_message.as_str().into(),
                db::clock_plus(delay.into())?.into(),
                db::clock()?.into(),
            ]),
        )?;
    }
    events(&scope, ids)
}

#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn nack_outbox_events(
    lease_owner: Option<&str>,
    event_ids: Option<Vec<Option<String>>>,
    error_message: Option<&str>,
) -> std::result::Result<
    SetOfIterator<'static, pgrx::composite_type!('static, "ledger.outbox_event")>,
    SqlError,
> {
    let rows = nack(lease_owner, event_ids_arg(event_ids), error_message)?;
    Ok(SetOfIterator::new(rows))
}

#[pg_extern(name = "nack_outbox_events", volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn nack_outbox_event(
    lease_owner: Option<&str>,
    event_id: Option<&str>,
    error_message: Option<&str>,
) -> std::result::Result<
    SetOfIterator<'static, pgrx::composite_type!('static, "ledger.outbox_event")>,
    SqlError,
> {
    let ids = event_id_arg(event_id).map(|id| vec![id]);
    Ok(SetOfIterator::new(nack(lease_owner, ids, error_message)?))
}

/// Puts a failed event back to pending, due now, with another 64 attempts. `attempt_count` is
/// kept (the history) and `replay_count` counts the replays. Wakes `ledger_outbox` like an
/// insert, so a consumer waiting on it picks the event up.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn replay_outbox_event(
    event_id: Option<&str>,
) -> std::result::Result<pgrx::composite_type!('static, "ledger.outbox_event"), SqlError> {
    let scope = scope::current()?;
    let id = event_id_arg(event_id)?;
    Ok(replay(&scope, &id)?.event)
}

/// A replayed event, with what its audit record says of it.
pub(crate) struct Replayed {
    pub event: Event,
    pub event_type: String,
    pub replay_count: i32,
}

/// The run of event `id`, read without a lock (a caller that locks the run does it before the
/// event, the order a purge of the run takes); None for an event of no run.
pub(crate) fn run_of(scope: &Scope, id: &str) -> Result<Option<String>> {
    db::select_one(
        "SELECT run_id FROM ledger.outbox WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([id.into()]),
        |r| db::opt::<String>(r, 1),
    )?
    .ok_or_else(|| not_found(id))
}

/// Replays the failed event `id` (P0002 `OUTBOX_EVENT_NOT_FOUND`, 55000 `OUTBOX_NOT_FAILED`).
pub(crate) fn replay(scope: &Scope, id: &str) -> Result<Replayed> {
    let held = locked(scope, id)?;
    rules::check_failed(id, &held.status)?;
    db::execute(
        include_str!("../sql/queries/replay_outbox_event.sql"),
        &scope.args([id.into(), db::clock()?.into()]),
    )?;
    wakeup(id);
    let event = events(scope, vec![id.to_owned()])?.into_iter().next();
    Ok(Replayed {
        event: event.ok_or_else(|| not_found(id))?,
        event_type: held.event_type,
        replay_count: held.replay_count + 1,
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    /// Three runs, so three `run.created` events, oldest first.
    fn three_events(tenant: &str) {
        set_scope(tenant, "w");
        for run in ["r1", "r2", "r3"] {
            Spi::run(&format!(
                "SELECT ledger.create_run('chat', run_id => '{run}')"
            ))
            .unwrap();
        }
    }

    fn event_of(run: &str) -> String {
        one(&format!(
            "SELECT id FROM ledger.outbox WHERE ledger.scope_tenant() = tenant_id AND run_id = '{run}'"
        ))
    }

    /// Makes the scope's events due now, as if their backoff or lease had passed.
    fn make_due(tenant: &str) {
        Spi::run(&format!(
            "UPDATE ledger.outbox SET available_at = clock_timestamp() - interval '1 second', \
                    lease_expires_at = clock_timestamp() - interval '1 second' WHERE tenant_id = '{tenant}'"
        ))
        .unwrap();
    }

    #[pg_test]
    fn claim_leases_due_events_oldest_first_and_ack_completes_them() {
        three_events("t-obx-claim");
        assert_eq!(
            one::<String>(
                "SELECT string_agg(run_id || ':' || status || ':' || attempt_count, ',') \
                   FROM ledger.claim_outbox_events('c1', 2, 30)"
            ),
            "r1:processing:1,r2:processing:1"
        );
        // The lease holder is in the table, not in what the consumer gets back.
        assert_eq!(
            one::<String>(
                "SELECT string_agg(run_id || ':' || lease_owner, ',' ORDER BY run_id) FROM ledger.outbox \
                  WHERE tenant_id = 't-obx-claim' AND status = 'processing'"
            ),
            "r1:c1,r2:c1"
        );
        assert!(one::<bool>(
            "SELECT bool_and(lease_expires_at BETWEEN clock_timestamp() + interval '29 seconds' \
                                                 AND clock_timestamp() + interval '31 seconds') \
               FROM ledger.outbox WHERE tenant_id = 't-obx-claim' AND status = 'processing'"
        ));
        // Held events are not claimed again; the defaults take the rest.
        assert_eq!(
            one::<String>("SELECT string_agg(run_id, ',') FROM ledger.claim_outbox_events('c2')"),
            "r3"
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c2')"),
            0
        );
        // An event not yet due is not claimed.
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r4')").unwrap();
        Spi::run("UPDATE ledger.outbox SET available_at = clock_timestamp() + interval '1 hour' WHERE tenant_id = 't-obx-claim' AND run_id = 'r4'").unwrap();
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c2')"),
            0
        );

        let (e1, e2, e3) = (event_of("r1"), event_of("r2"), event_of("r3"));
        // Only the holder's ids count; others, unknown ones and repeats are ignored.
        assert_eq!(
            one::<i32>(&format!(
                "SELECT ledger.ack_outbox_events('c1', ARRAY['{e1}', '{e2}', '{e3}', '{e1}', 'obx_nope'])"
            )),
            2
        );
        assert_eq!(
            one::<i32>(&format!(
                "SELECT ledger.ack_outbox_events('c1', ARRAY['{e1}'])"
            )),
            0,
            "already done"
        );
        assert_eq!(
            one::<i32>("SELECT ledger.ack_outbox_events('c1', '{}'::text[])"),
            0
        );
        assert_eq!(
            one::<String>(
                "SELECT string_agg(run_id || ':' || status, ',' ORDER BY run_id) FROM ledger.outbox \
                  WHERE tenant_id = 't-obx-claim' AND processed_at IS NOT NULL \
                    AND lease_owner IS NULL AND lease_expires_at IS NULL"
            ),
            "r1:done,r2:done"
        );
        assert_eq!(
            one::<String>("SELECT status || ':' || lease_owner FROM ledger.outbox WHERE tenant_id = 't-obx-claim' AND run_id = 'r3'"),
            "processing:c2"
        );
    }

    #[pg_test]
    fn an_expired_lease_is_taken_over_and_the_old_holder_can_no_longer_ack() {
        set_scope("t-obx-expire", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r1')").unwrap();
        let e1 = event_of("r1");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c1', lease_seconds => 1)"),
            1
        );
        make_due("t-obx-expire");
        assert_eq!(
            one::<String>(
                "SELECT status || ':' || attempt_count FROM ledger.claim_outbox_events('c2')"
            ),
            "processing:2"
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT lease_owner FROM ledger.outbox WHERE id = '{e1}'"
            )),
            "c2"
        );
        assert_eq!(
            one::<i32>(&format!(
                "SELECT ledger.ack_outbox_events('c1', ARRAY['{e1}'])"
            )),
            0
        );
        assert_error(
            &format!("SELECT ledger.nack_outbox_events('c1', '{e1}', 'late')"),
            "55000",
            "OUTBOX_NOT_LEASED",
        );
        assert_eq!(
            one::<i32>(&format!(
                "SELECT ledger.ack_outbox_events('c2', ARRAY['{e1}'])"
            )),
            1
        );
        assert_eq!(
            one::<String>("SELECT status || ':' || attempt_count FROM ledger.outbox WHERE tenant_id = 't-obx-expire'"),
            "done:2"
        );
    }

    #[pg_test]
    fn nack_backs_off_and_keeps_the_error() {
        set_scope("t-obx-nack", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r1')").unwrap();
        let e1 = event_of("r1");
        for (attempt, delay) in [(1, 1), (2, 2), (3, 4), (4, 8)] {
            assert_eq!(
                one::<i32>("SELECT attempt_count FROM ledger.claim_outbox_events('c1')"),
                attempt
            );
            let row = format!(
                "SELECT status || ':' || attempt_count || ':' || error_message || ':' || \
                        (lease_expires_at IS NULL AND processed_at IS NULL) \
                   FROM ledger.nack_outbox_events('c1', '{e1}', 'boom {attempt}')"
            );
            assert_eq!(
                one::<String>(&row),
                format!("pending:{attempt}:boom {attempt}:true")
            );
            let wait = one::<f64>(
                "SELECT extract(epoch FROM available_at - clock_timestamp())::float8 FROM ledger.outbox WHERE tenant_id = 't-obx-nack'",
            );
            assert!(
                wait > f64::from(delay) - 0.5 && wait <= f64::from(delay),
                "attempt {attempt}: {wait}"
            );
            assert_eq!(
                one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c1')"),
                0,
                "not due during the backoff"
            );
            make_due("t-obx-nack");
        }
        // The error is cut to 8192 characters; an empty one is accepted.
        Spi::run("SELECT ledger.claim_outbox_events('c1')").unwrap();
        assert_eq!(
            one::<i32>(&format!(
                "SELECT length(error_message) FROM ledger.nack_outbox_events('c1', '{e1}', repeat('x', 10000))"
            )),
            8192
        );
        make_due("t-obx-nack");
        Spi::run("SELECT ledger.claim_outbox_events('c1')").unwrap();
        assert_eq!(
            one::<String>(&format!(
                "SELECT status || ':[' || error_message || ']' FROM ledger.nack_outbox_events('c1', '{e1}', '')"
            )),
            "pending:[]"
        );
    }

    #[pg_test]
    fn the_64th_attempt_fails_the_event_and_replay_gives_another_64() {
        set_scope("t-obx-fail", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r1')").unwrap();
        let e1 = event_of("r1");
        Spi::run("UPDATE ledger.outbox SET attempt_count = 62 WHERE tenant_id = 't-obx-fail'")
            .unwrap();
        Spi::run("SELECT ledger.claim_outbox_events('c1')").unwrap();
        assert_eq!(
            one::<String>(&format!(
                "SELECT status || ':' || attempt_count FROM ledger.nack_outbox_events('c1', '{e1}', 'no')"
            )),
            "pending:63"
        );
        make_due("t-obx-fail");
        Spi::run("SELECT ledger.claim_outbox_events('c1')").unwrap();
        assert_eq!(
            one::<String>(&format!(
                "SELECT status || ':' || attempt_count || ':' || (processed_at IS NOT NULL) || ':' || (lease_expires_at IS NULL) \
                   FROM ledger.nack_outbox_events('c1', '{e1}', 'still no')"
            )),
            "failed:64:true:true"
        );
        make_due("t-obx-fail");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c1')"),
            0,
            "a failed event is never claimed"
        );

        assert_eq!(
            one::<String>(&format!(
                "SELECT status || ':' || attempt_count || ':' || replay_count || ':' || (processed_at IS NULL) || ':' || \
                        (available_at <= clock_timestamp()) || ':' || error_message \
                   FROM ledger.replay_outbox_event('{e1}')"
            )),
            "pending:64:1:true:true:still no"
        );
        // A fresh budget: the backoff starts over, and 64 more attempts until it fails again.
        assert_eq!(
            one::<i32>("SELECT attempt_count FROM ledger.claim_outbox_events('c1')"),
            65
        );
        let wait = one::<f64>(&format!(
            "SELECT extract(epoch FROM available_at - clock_timestamp())::float8 FROM ledger.nack_outbox_events('c1', '{e1}', 'x')"
        ));
        assert!(wait > 0.5 && wait <= 1.0, "{wait}");
        Spi::run("UPDATE ledger.outbox SET attempt_count = 127 WHERE tenant_id = 't-obx-fail'")
            .unwrap();
        make_due("t-obx-fail");
        assert_eq!(
            one::<i32>("SELECT attempt_count FROM ledger.claim_outbox_events('c1')"),
            128
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT status FROM ledger.nack_outbox_events('c1', '{e1}', 'x')"
            )),
            "failed"
        );
        assert_eq!(
            one::<i32>(&format!(
                "SELECT replay_count FROM ledger.replay_outbox_event('{e1}')"
            )),
            2
        );
    }

    /// Fails the event of `run`, as 64 failed deliveries would; returns its id.
    fn failed_event_of(run: &str) -> String {
        let id = event_of(run);
        Spi::run(&format!(
            "UPDATE ledger.outbox SET status = 'failed', attempt_count = 64 WHERE id = '{id}'"
        ))
        .unwrap();
        id
    }

    /// The scope's audit records, as JSON, oldest first.
    fn audits() -> serde_json::Value {
        one::<pgrx::JsonB>(
            "SELECT coalesce(jsonb_agg(jsonb_build_object('run_id', run_id, 'step_id', step_id, \
                    'gateway_type', gateway_type, 'outcome', outcome, 'actor', actor, 'payload', payload) \
                    ORDER BY created_at, id), '[]') \
               FROM ledger.audit_events WHERE tenant_id = ledger.scope_tenant()",
        )
        .0
    }

    #[pg_test]
    fn a_replay_by_a_person_writes_its_audit_record_for_the_events_run() {
        three_events("t-obx-audit");
        let e1 = failed_event_of("r1");
        assert_eq!(
            one::<String>(&format!(
                "SELECT status || ':' || attempt_count || ':' || replay_count || ':' || run_id \
                   FROM ledger.replay_outbox_event('{e1}', 'ops@acme', \
                        'downstream fixed, key sk-abcdefghijklmnopqrstuvwx')"
            )),
            "pending:64:1:r1"
        );
        let first = audits();
        let note = first[0]["payload"]["note"].as_str().unwrap_or_default();
        assert!(note.starts_with("downstream fixed"), "{note}");
        assert!(!note.contains("sk-abc"), "the note is redacted: {note}");
        assert_eq!(
            first,
            serde_json::json!([{
                "run_id": "r1",
                "step_id": null,
                "gateway_type": "outbox.replay",
                "outcome": "replayed",
                "actor": "ops@acme",
                "payload": {
                    "outbox_event_id": e1,
                    "event_type": "run.created",
                    "replay_count": 1,
                    "note": note,
                },
            }])
        );
        // Announced in the run's feed, like every audit record of a run.
        assert_eq!(
            one::<String>(
                "SELECT event_type FROM ledger.run_events \
                  WHERE tenant_id = 't-obx-audit' AND run_id = 'r1' ORDER BY seq DESC LIMIT 1"
            ),
            "audit.recorded"
        );
        // Failed again and replayed without a note: the second replay, its own record.
        Spi::run(&format!(
            "UPDATE ledger.outbox SET status = 'failed' WHERE id = '{e1}'"
        ))
        .unwrap();
        Spi::run(&format!(
            "SELECT ledger.replay_outbox_event('{e1}', actor => 'lead')"
        ))
        .unwrap();
        let both = audits();
        assert_eq!(both[0], first[0]);
        assert_eq!(both[1]["actor"], "lead");
        assert_eq!(
            both[1]["payload"],
            serde_json::json!({"outbox_event_id": e1, "event_type": "run.created", "replay_count": 2, "note": null})
        );
    }

    #[pg_test]
    fn a_replay_without_an_actor_or_of_an_event_not_failed_writes_nothing() {
        three_events("t-obx-actor");
        let e1 = failed_event_of("r1");
        let e2 = event_of("r2");
        let state = || {
            one::<String>(
                "SELECT string_agg(run_id || ':' || status || ':' || replay_count, ',' ORDER BY run_id) \
                   FROM ledger.outbox WHERE tenant_id = 't-obx-actor'",
            ) + &format!(
                " audits={} events={}",
                one::<i64>("SELECT count(*) FROM ledger.audit_events WHERE tenant_id = 't-obx-actor'"),
                one::<i64>("SELECT count(*) FROM ledger.run_events WHERE tenant_id = 't-obx-actor'")
            )
        };
        let before = state();
        assert_eq!(
            before,
            "r1:failed:0,r2:pending:0,r3:pending:0 audits=0 events=3"
        );
        for actor in ["NULL", "''"] {
            let e = assert_error(
                &format!("SELECT ledger.replay_outbox_event('{e1}', {actor}, 'why')"),
                "22023",
                "ARGUMENT_REQUIRED",
            );
            assert_eq!(e.detail["argument"], "actor");
        }
        assert_error(
            &format!("SELECT ledger.replay_outbox_event('{e2}', 'ops')"),
            "55000",
            "OUTBOX_NOT_FAILED",
        );
        assert_error(
            "SELECT ledger.replay_outbox_event('obx_nope', 'ops')",
            "P0002",
            "OUTBOX_EVENT_NOT_FOUND",
        );
        assert_eq!(state(), before);
    }

    #[pg_test]
    fn a_replay_of_an_event_without_a_run_is_audited_for_the_scope() {
        three_events("t-obx-norun");
        let e1 = failed_event_of("r1");
        // As a purge of its run leaves an event not delivered yet.
        Spi::run(&format!(
            "UPDATE ledger.outbox SET run_id = NULL WHERE id = '{e1}'"
        ))
        .unwrap();
        assert_eq!(
            one::<String>(&format!(
                "SELECT status || ':' || replay_count || ':' || (run_id IS NULL) \
                   FROM ledger.replay_outbox_event('{e1}', 'ops', 'purged run')"
            )),
            "pending:1:true"
        );
        assert_eq!(
            audits(),
            serde_json::json!([{
                "run_id": null,
                "step_id": null,
                "gateway_type": "outbox.replay",
                "outcome": "replayed",
                "actor": "ops",
                "payload": {
                    "outbox_event_id": e1,
                    "event_type": "run.created",
                    "replay_count": 1,
                    "note": "purged run",
                },
            }])
        );
        // No run, so no feed event.
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_events WHERE tenant_id = 't-obx-norun'"),
            3
        );
    }

    #[pg_test]
    fn the_replay_by_event_id_alone_is_unchanged_and_writes_no_audit() {
        three_events("t-obx-plain");
        let e1 = failed_event_of("r1");
        assert_eq!(
            one::<String>(&format!(
                "SELECT status || ':' || attempt_count || ':' || replay_count \
                   FROM ledger.replay_outbox_event('{e1}')"
            )),
            "pending:64:1"
        );
        assert_eq!(audits(), serde_json::json!([]));
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_events WHERE tenant_id = 't-obx-plain'"),
            3
        );
    }

    #[pg_test]
    fn a_lease_that_expires_on_the_last_attempt_fails_the_event() {
        set_scope("t-obx-crash", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r1')").unwrap();
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r2')").unwrap();
        Spi::run("UPDATE ledger.outbox SET attempt_count = 63 WHERE tenant_id = 't-obx-crash' AND run_id = 'r1'")
            .unwrap();
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c1')"),
            2
        );
        // c1 dies holding both; r1 was on its 64th attempt.
        make_due("t-obx-crash");
        assert_eq!(
            one::<String>("SELECT string_agg(run_id || ':' || attempt_count, ',') FROM ledger.claim_outbox_events('c2')"),
            "r2:2"
        );
        assert_eq!(
            one::<String>(
                "SELECT status || ':' || attempt_count || ':' || (processed_at IS NOT NULL) || ':' || (lease_owner IS NULL) || ':' || error_message \
                   FROM ledger.outbox WHERE tenant_id = 't-obx-crash' AND run_id = 'r1'"
            ),
            "failed:64:true:true:the lease of attempt 64 (lease owner c1) expired and no attempts are left"
        );
    }

    #[pg_test]
    fn nack_and_replay_refuse_events_in_the_wrong_state() {
        set_scope("t-obx-state", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r1')").unwrap();
        let e1 = event_of("r1");
        let e = assert_error(
            &format!("SELECT ledger.nack_outbox_events('c1', '{e1}', 'x')"),
            "55000",
            "OUTBOX_NOT_LEASED",
        );
        assert_eq!(e.detail["status"], "pending");
        let e = assert_error(
            &format!("SELECT ledger.replay_outbox_event('{e1}')"),
            "55000",
            "OUTBOX_NOT_FAILED",
        );
        assert!(e.message.contains("not in failed state"), "{e:?}");
        Spi::run("SELECT ledger.claim_outbox_events('c1')").unwrap();
        let e = assert_error(
            &format!("SELECT ledger.nack_outbox_events('c2', '{e1}', 'x')"),
            "55000",
            "OUTBOX_NOT_LEASED",
        );
        assert_eq!(
            (
                e.detail["lease_owner"].as_str(),
                e.detail["held_by"].as_str()
            ),
            (Some("c2"), Some("c1"))
        );
        assert_error(
            &format!("SELECT ledger.replay_outbox_event('{e1}')"),
            "55000",
            "OUTBOX_NOT_FAILED",
        );
        Spi::run(&format!(
            "SELECT ledger.ack_outbox_events('c1', ARRAY['{e1}'])"
        ))
        .unwrap();
        assert_error(
            &format!("SELECT ledger.nack_outbox_events('c1', '{e1}', 'x')"),
            "55000",
            "OUTBOX_NOT_LEASED",
        );
        assert_error(
            &format!("SELECT ledger.replay_outbox_event('{e1}')"),
            "55000",
            "OUTBOX_NOT_FAILED",
        );
        for sql in [
            "SELECT ledger.nack_outbox_events('c1', 'obx_nope', 'x')",
            "SELECT ledger.replay_outbox_event('obx_nope')",
        ] {
            let e = assert_error(sql, "P0002", "OUTBOX_EVENT_NOT_FOUND");
            assert_eq!(e.detail["id"], "obx_nope");
        }
        // Refused calls changed nothing.
        assert_eq!(
            one::<String>("SELECT status || ':' || attempt_count || ':' || replay_count FROM ledger.outbox WHERE tenant_id = 't-obx-state'"),
            "done:1:0"
        );
    }

    #[pg_test]
    fn another_scopes_events_are_never_claimed_or_touched() {
        three_events("t-obx-a");
        let e1 = event_of("r1");
        Spi::run(&format!(
            "UPDATE ledger.outbox SET status = 'failed' WHERE tenant_id = 't-obx-a' AND id = '{e1}'"
        ))
        .unwrap();
        set_scope("t-obx-a", "other");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c1', 1000)"),
            0
        );
        set_scope("t-obx-b", "w");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c1', 1000)"),
            0
        );
        assert_eq!(
            one::<i32>(&format!(
                "SELECT ledger.ack_outbox_events('c1', ARRAY['{e1}'])"
            )),
            0
        );
        assert_error(
            &format!("SELECT ledger.nack_outbox_events('c1', '{e1}', 'x')"),
            "P0002",
            "OUTBOX_EVENT_NOT_FOUND",
        );
        assert_error(
            &format!("SELECT ledger.replay_outbox_event('{e1}')"),
            "P0002",
            "OUTBOX_EVENT_NOT_FOUND",
        );
        assert_eq!(
            one::<String>(
                "SELECT string_agg(status || ':' || attempt_count, ',' ORDER BY run_id) FROM ledger.outbox WHERE tenant_id = 't-obx-a'"
            ),
            "failed:0,pending:0,pending:0"
        );
        set_scope("t-obx-a", "w");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_outbox_events('c1', 1000)"),
            2
        );
    }

    #[pg_test]
    fn one_id_or_many_and_a_batch_nack_is_all_or_nothing() {
        three_events("t-obx-batch");
        let (e1, e2, e3) = (event_of("r1"), event_of("r2"), event_of("r3"));
        Spi::run("SELECT ledger.claim_outbox_events('c1', 2)").unwrap();
        Spi::run("SELECT ledger.claim_outbox_events('c2')").unwrap();
        // e3 is held by c2: the batch fails as a whole and changes nothing.
        let e = assert_error(
            &format!(
                "SELECT * FROM ledger.nack_outbox_events('c1', ARRAY['{e1}', '{e3}'], 'down')"
            ),
            "55000",
            "OUTBOX_NOT_LEASED",
        );
        assert_eq!(e.detail["id"], e3.as_str());
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.outbox WHERE tenant_id = 't-obx-batch' AND status = 'processing'"),
            3
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT string_agg(status || ':' || error_message, ',') \
                   FROM ledger.nack_outbox_events('c1', ARRAY['{e2}', '{e1}', '{e1}'], 'down')"
            )),
            "pending:down,pending:down"
        );
        assert_eq!(
            one::<i32>(&format!("SELECT ledger.ack_outbox_events('c2', '{e3}')")),
            1
        );
        assert_eq!(
            one::<i32>(&format!("SELECT ledger.ack_outbox_events('c2', '{e3}')")),
            0
        );
        // An array written as an untyped literal would pick the one-id variant: refused, not ignored.
        let e = assert_error(
            &format!("SELECT ledger.ack_outbox_events('c2', '{{{e3}}}')"),
            "22023",
            "ID_INVALID",
        );
        assert!(e.message.contains("array literal"), "{e:?}");
        assert_eq!(
            one::<i32>(&format!(
                "SELECT ledger.ack_outbox_events('c2', '{{{e3}}}'::text[])"
            )),
            0
        );
    }

    #[pg_test]
    fn bad_arguments_are_refused() {
        set_scope("t-obx-args", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r1')").unwrap();
        let e1 = event_of("r1");
        for (sql, code) in [
            (
                "SELECT ledger.claim_outbox_events(NULL)",
                "ARGUMENT_REQUIRED",
            ),
            ("SELECT ledger.claim_outbox_events('')", "ID_INVALID"),
            ("SELECT ledger.claim_outbox_events('a b')", "ID_INVALID"),
            (
                "SELECT ledger.claim_outbox_events('c1', NULL)",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.claim_outbox_events('c1', 0)",
                "LIMIT_INVALID",
            ),
            (
                "SELECT ledger.claim_outbox_events('c1', 1001)",
                "LIMIT_INVALID",
            ),
            (
                "SELECT ledger.claim_outbox_events('c1', 50, NULL)",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.claim_outbox_events('c1', 50, 0)",
                "TIMEOUT_INVALID",
            ),
            (
                "SELECT ledger.claim_outbox_events('c1', 50, 86401)",
                "TIMEOUT_INVALID",
            ),
            (
                "SELECT ledger.ack_outbox_events(NULL, '{}')",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.ack_outbox_events('c1', NULL)",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.ack_outbox_events('c1', ARRAY[NULL])",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.ack_outbox_events('c1', ARRAY['a b'])",
                "ID_INVALID",
            ),
            (
                "SELECT ledger.nack_outbox_events(NULL, 'obx_x', 'x')",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.nack_outbox_events('c1', NULL, 'x')",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.nack_outbox_events('c1', 'obx_x', NULL)",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.nack_outbox_events('c1', '', 'x')",
                "ID_INVALID",
            ),
            (
                "SELECT ledger.replay_outbox_event(NULL)",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.replay_outbox_event(repeat('x', 129))",
                "ID_INVALID",
            ),
        ] {
            assert_error(sql, "22023", code);
        }
        // Nothing was claimed by the refused calls.
        assert_eq!(
            one::<String>(&format!(
                "SELECT status FROM ledger.outbox WHERE id = '{e1}'"
            )),
            "pending"
        );
        Spi::run("SELECT set_config('ledger.tenant_id', '', true)").unwrap();
        for sql in [
            "SELECT ledger.claim_outbox_events('c1')",
            "SELECT ledger.ack_outbox_events('c1', '{}')",
            "SELECT ledger.nack_outbox_events('c1', 'obx_x', 'x')",
            "SELECT ledger.replay_outbox_event('obx_x')",
        ] {
            assert_error(sql, "42501", "SCOPE_MISSING");
        }
    }
}
