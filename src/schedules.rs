//! Schedules: `set_schedule` names a cron expression read in a time zone and the run it creates;
//! `fire_schedules` (run every minute by pg_cron or a worker) creates the runs of the firings
//! that are due. A firing's run has the request id `schedule:<id>:<firing in UTC>`, so it is
//! created once however many sweepers fire it; each schedule's row is locked SKIP LOCKED, so two
//! sweepers never wait for each other either. Time zones are the database's (`pg_timezone_names`).

use crate::audit;
use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::redaction::{free_text, redacted_object};
use crate::rows;
use crate::runs::{self, NewRun};
use crate::scope::{self, Scope};
use ledger_model::args::{optional_label, required, required_id, required_label};
use ledger_model::events::AuditKind;
use ledger_model::run_leases;
use ledger_model::schedules::{CatchUp, Cron, Minute, MAX_CATCH_UP};
use pgrx::prelude::*;
use serde_json::json;

type ScheduleRow = pgrx::composite_type!('static, "ledger.schedules");

/// The local minute of `at` in time zone `tz`.
fn local(tz: &str, at: TimestampWithTimeZone) -> Result<Minute> {
    db::select_one(
        "SELECT extract(year FROM l)::int, extract(month FROM l)::int, extract(day FROM l)::int, \
                extract(hour FROM l)::int, extract(minute FROM l)::int \
           FROM (SELECT timezone($1, $2) AS l) x",
        &[tz.into(), at.into()],
        |r| {
            let field = |i| db::req::<i32>(r, i);
            Ok(Minute {
                year: field(1)?,
                month: field(2)? as u32,
                day: field(3)? as u32,
                hour: field(4)? as u32,
                minute: field(5)? as u32,
            })
        },
    )?
    .ok_or_else(|| LedgerError::internal("no local time"))
}

/// The instant of local minute `m` in `tz`, and its UTC text (a local time that a clock change
/// skips is read as the database reads it: shifted by the change).
fn instant(tz: &str, m: Minute) -> Result<(TimestampWithTimeZone, String)> {
    db::select_one(
        "SELECT t, to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI\"Z\"') \
           FROM (SELECT timezone($1, make_timestamp($2, $3, $4, $5, $6, 0)) AS t) x",
        &[
            tz.into(),
            m.year.into(),
            (m.month as i32).into(),
            (m.day as i32).into(),
            (m.hour as i32).into(),
            (m.minute as i32).into(),
        ],
        |r| Ok((db::req(r, 1)?, db::req(r, 2)?)),
    )?
    .ok_or_else(|| LedgerError::internal("no instant"))
}

/// The first firing after local minute `after`, if the expression names one.
fn next_fire(cron: &Cron, tz: &str, after: Minute) -> Result<Option<TimestampWithTimeZone>> {
    cron.next_after(after)
        .map(|m| instant(tz, m).map(|(t, _)| t))
        .transpose()
}

fn row(scope: &Scope, id: &str) -> Result<ScheduleRow> {
    rows::scoped_row(
        scope,
        "ledger.schedules",
        id,
        Code::ScheduleNotFound,
        "schedule",
    )
}

/// Creates or replaces schedule `schedule_id`: at every time `cron` names in `time_zone`, a run
/// of `mode` (with `kind`, `inputs`, `priority` and `concurrency_key`) is created by
/// `fire_schedules`. The next firing counts from now; a paused schedule stays paused.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn set_schedule(
    schedule_id: Option<&str>,
    cron: Option<&str>,
    mode: Option<&str>,
    inputs: default!(Option<Jsonb>, "NULL"),
    time_zone: default!(Option<&str>, "'UTC'"),
    kind: default!(Option<&str>, "NULL"),
    catch_up: default!(Option<&str>, "'latest'"),
    priority: default!(Option<i32>, "0"),
    concurrency_key: default!(Option<&str>, "NULL"),
    actor: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.schedules"), SqlError> {
    let scope = scope::current()?;
    let id = required_id("schedule_id", schedule_id)?;
    let expr = required("cron", cron)?;
    let parsed = Cron::parse(expr)?;
    let mode = required_label("mode", mode)?;
    let kind = optional_label("kind", kind)?;
    let concurrency_key = optional_label("concurrency_key", concurrency_key)?;
    let tz = time_zone_of(time_zone)?;
    let catch_up = CatchUp::parse(required("catch_up", catch_up)?)?;
    let priority = run_leases::priority(priority)?;
    let inputs = inputs
        .map(|i| redacted_object("inputs", Some(i)))
        .transpose()?;
    let actor = free_text(optional_label("actor", actor)?);
    let next = next_fire(&parsed, tz, local(tz, db::now()?)?)?;
    db::execute(
        "INSERT INTO ledger.schedules (tenant_id, workspace_id, id, cron, time_zone, mode, kind, inputs, \
                priority, concurrency_key, catch_up, next_fire_at, updated_by, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) \
         ON CONFLICT (tenant_id, workspace_id, id) DO UPDATE \
            SET cron = excluded.cron, time_zone = excluded.time_zone, mode = excluded.mode, \
                kind = excluded.kind, inputs = excluded.inputs, priority = excluded.priority, \
                concurrency_key = excluded.concurrency_key, catch_up = excluded.catch_up, \
                next_fire_at = excluded.next_fire_at, updated_by = excluded.updated_by, \
                updated_at = excluded.updated_at",
        &scope.args([
            id.into(),
            expr.into(),
            tz.into(),
            mode.into(),
            kind.into(),
            inputs.as_ref().map(Jsonb::from).into(),
            priority.into(),
            concurrency_key.into(),
            catch_up.as_str().into(),
            next.into(),
            actor.as_deref().into(),
            db::now()?.into(),
        ]),
    )?;
    audited(
        &scope,
        id,
        "set",
        actor.as_deref(),
        json!({"cron": expr, "time_zone": tz, "mode": mode}),
    )?;
    Ok(row(&scope, id)?)
}

/// A time zone the database knows by name (22023 `TIME_ZONE_UNKNOWN`).
fn time_zone_of(time_zone: Option<&str>) -> Result<&str> {
    let tz = required_label("time_zone", time_zone)?;
    let known = db::select_one(
        "SELECT EXISTS (SELECT FROM pg_timezone_names WHERE name = $1)",
        &[tz.into()],
        |r| db::req::<bool>(r, 1),
    )?
    .unwrap_or(false);
    if !known {
        return Err(LedgerError::new(
            Code::TimeZoneUnknown,
            "time_zone must be a time zone name such as UTC or Europe/Berlin",
        )
        .with("time_zone", tz));
    }
    Ok(tz)
}

fn audited(
    scope: &Scope,
    id: &str,
    outcome: &str,
    actor: Option<&str>,
    extra: serde_json::Value,
) -> Result<()> {
    let mut payload = json!({"schedule_id": id});
    if let (Some(p), serde_json::Value::Object(e)) = (payload.as_object_mut(), extra) {
        p.extend(e);
    }
    audit::write(
        scope,
        None,
        None,
        AuditKind::ScheduleSet,
        outcome,
        actor,
        payload,
    )
}

/// Pauses (`paused` true) or resumes a schedule. A paused schedule fires nothing; resumed, it
/// fires from the next time its expression names (the firings while paused are skipped).
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn pause_schedule(
    schedule_id: Option<&str>,
    paused: default!(Option<bool>, "true"),
    actor: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.schedules"), SqlError> {
    let scope = scope::current()?;
    let id = required_id("schedule_id", schedule_id)?;
    let paused = paused.ok_or_else(|| LedgerError::required("paused"))?;
    let actor = free_text(optional_label("actor", actor)?);
    let (expr, tz) = db::write_one(
        "SELECT cron, time_zone FROM ledger.schedules \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 FOR UPDATE",
        &scope.args([id.into()]),
        |r| Ok((db::req::<String>(r, 1)?, db::req::<String>(r, 2)?)),
    )?
    .ok_or_else(|| LedgerError::not_found(Code::ScheduleNotFound, "schedule", id))?;
    let next = next_fire(&Cron::parse(&expr)?, &tz, local(&tz, db::now()?)?)?;
    db::execute(
        "UPDATE ledger.schedules SET paused = $4, \
                next_fire_at = CASE WHEN paused = $4 THEN next_fire_at ELSE $5 END, \
                updated_by = $6, updated_at = now() \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([
            id.into(),
            paused.into(),
            next.into(),
            actor.as_deref().into(),
        ]),
    )?;
    let outcome = if paused { "paused" } else { "resumed" };
    audited(&scope, id, outcome, actor.as_deref(), json!({}))?;
    Ok(row(&scope, id)?)
}

/// Removes a schedule (runs it created stay); returns whether it existed.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn drop_schedule(
    schedule_id: Option<&str>,
    actor: default!(Option<&str>, "NULL"),
) -> std::result::Result<bool, SqlError> {
    let scope = scope::current()?;
    let id = required_id("schedule_id", schedule_id)?;
    let actor = free_text(optional_label("actor", actor)?);
    let dropped = db::write_one(
        "DELETE FROM ledger.schedules WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 \
         RETURNING cron",
        &scope.args([id.into()]),
        |r| db::req::<String>(r, 1),
    )?;
    if let Some(expr) = &dropped {
        audited(
            &scope,
            id,
            "dropped",
            actor.as_deref(),
            json!({"cron": expr}),
        )?;
    }
    Ok(dropped.is_some())
}

/// Creates the runs of every due firing of the scope's schedules and moves each schedule to its
/// next firing; returns how many runs it created (or found created: a firing makes one run).
/// With `any_scope` (members of ledger_operator only), every scope's (every granted one's, when
/// the login role is bound), each in its own scope.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn fire_schedules(any_scope: default!(Option<bool>, false)) -> std::result::Result<i32, SqlError> {
    if !any_scope.unwrap_or(false) {
        return Ok(feed::collected(|| fire(&scope::current()?))?);
    }
    Ok(scope::across(
        "SELECT tenant_id, workspace_id FROM ledger_dispatch.due_schedule_scopes()",
        |scope| feed::collected(|| fire(scope)),
    )?)
}

/// A due schedule, locked.
struct Due {
    cron: String,
    tz: String,
    mode: String,
    kind: Option<String>,
    inputs: Option<Jsonb>,
    priority: i32,
    concurrency_key: Option<String>,
    catch_up: String,
    next_fire_at: TimestampWithTimeZone,
}

fn fire(scope: &Scope) -> Result<i32> {
    let due = db::select(
        "SELECT id FROM ledger.schedules \
          WHERE tenant_id = $1 AND workspace_id = $2 AND NOT paused AND next_fire_at <= now() \
          ORDER BY next_fire_at, id",
        &scope.args([]),
        |r| db::req::<String>(r, 1),
    )?;
    let mut fired = 0;
    for id in due {
        // Another sweeper holds it: it fires these firings.
        let Some(s) = db::write_one(
            "SELECT cron, time_zone, mode, kind, inputs, priority, concurrency_key, catch_up, next_fire_at \
               FROM ledger.schedules \
              WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 AND NOT paused \
                AND next_fire_at <= now() \
              FOR UPDATE SKIP LOCKED",
            &scope.args([id.as_str().into()]),
            |r| {
                Ok(Due {
                    cron: db::req(r, 1)?,
                    tz: db::req(r, 2)?,
                    mode: db::req(r, 3)?,
                    kind: db::opt(r, 4)?,
                    inputs: db::opt(r, 5)?,
                    priority: db::req(r, 6)?,
                    concurrency_key: db::opt(r, 7)?,
                    catch_up: db::req(r, 8)?,
                    next_fire_at: db::req(r, 9)?,
                })
            },
        )?
        else {
            continue;
        };
        fired += fire_one(scope, &id, &s)?;
    }
    Ok(fired)
}

/// Creates the runs of the due firings of schedule `id` (locked) and moves it to its next one.
fn fire_one(scope: &Scope, id: &str, s: &Due) -> Result<i32> {
    let cron = Cron::parse(&s.cron)?;
    let catch_up = CatchUp::parse(&s.catch_up)?;
    let until = local(&s.tz, db::now()?)?;
    let mut firings = vec![local(&s.tz, s.next_fire_at)?];
    let mut at = firings[0];
    while let Some(next) = cron.next_after(at).filter(|n| *n <= until) {
        match catch_up {
            CatchUp::Latest => firings[0] = next,
            CatchUp::All if firings.len() < MAX_CATCH_UP => firings.push(next),
            CatchUp::All => break,
        }
        at = next;
    }
    let mut last = None;
    for firing in &firings {
        let (when, utc) = instant(&s.tz, *firing)?;
        let request_id = format!("schedule:{id}:{utc}");
        let run_id = runs::create(
            scope,
            NewRun {
                mode: &s.mode,
                inputs: s.inputs.clone(),
                kind: s.kind.as_deref(),
                request_id: Some(&request_id),
                priority: Some(s.priority),
                concurrency_key: s.concurrency_key.as_deref(),
                ..NewRun::default()
            },
        )?;
        last = Some((when, run_id));
    }
    let last_local = firings[firings.len() - 1];
    let next = next_fire(&cron, &s.tz, last_local)?;
    let (when, run_id) =
        last.ok_or_else(|| LedgerError::internal("a due schedule fired nothing"))?;
    db::execute(
        "UPDATE ledger.schedules SET next_fire_at = $4, last_fired_at = $5, last_run_id = $6 \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([id.into(), next.into(), when.into(), run_id.as_str().into()]),
    )?;
    Ok(firings.len() as i32)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn text(query: &str) -> String {
        one::<String>(query)
    }

    /// Moves a schedule's next firing `minutes` into the past, as if that long went by.
    fn elapse(id: &str, minutes: i32) {
        Spi::run(&format!(
            "UPDATE ledger.schedules SET next_fire_at = next_fire_at - make_interval(mins => {minutes}) WHERE id = '{id}'"
        ))
        .unwrap();
    }

    /// A schedule fires once per firing: its run is created with the firing in its request id,
    /// a second sweep creates nothing, and the schedule moves to its next firing.
    #[pg_test]
    fn a_due_schedule_creates_one_run_per_firing() {
        set_scope("t-schedules", "w");
        let s = text(
            "SELECT concat_ws('|', cron, time_zone, catch_up, paused, next_fire_at > now(), \
                    next_fire_at <= now() + interval '1 hour', inputs->>'api_key') \
               FROM ledger.set_schedule('hourly-report', '0 * * * *', 'report', \
                 '{\"api_key\": \"sk-live-0123456789abcdefghij\", \"team\": \"ops\"}', \
                 kind => 'digest', priority => 5, actor => 'ana')",
        );
        assert_eq!(s, "0 * * * *|UTC|latest|f|t|t|[REDACTED]");
        assert_eq!(one::<i32>("SELECT ledger.fire_schedules()"), 0);
        elapse("hourly-report", 60);
        assert_eq!(one::<i32>("SELECT ledger.fire_schedules()"), 1);
        assert_eq!(one::<i32>("SELECT ledger.fire_schedules()"), 0);
        assert_eq!(
            text(
                "SELECT concat_ws('|', mode, kind, priority, inputs->>'team', \
                        request_id ~ '^schedule:hourly-report:\\d{4}-\\d\\d-\\d\\dT\\d\\d:00Z$') \
                   FROM ledger.runs"
            ),
            "report|digest|5|ops|t"
        );
        assert_eq!(
            text(
                "SELECT concat_ws('|', s.last_run_id = r.id, s.next_fire_at > now(), \
                        s.last_fired_at = date_trunc('hour', now())) \
                   FROM ledger.schedules s, ledger.runs r"
            ),
            "t|t|t"
        );
        // The same firing fired again (a sweeper that read it before the move) finds its run.
        Spi::run("UPDATE ledger.schedules SET next_fire_at = last_fired_at").unwrap();
        assert_eq!(one::<i32>("SELECT ledger.fire_schedules()"), 1);
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.runs"), 1);
        assert_eq!(
            text(
                "SELECT string_agg(outcome || ':' || coalesce(actor, '-'), ' ' ORDER BY created_at, id) \
                   FROM ledger.audit_events WHERE gateway_type = 'schedule.set'"
            ),
            "set:ana"
        );
    }

    /// Missed firings: latest runs once for the most recent, all runs each one (oldest first).
    /// A paused schedule fires nothing and skips its firings; a dropped one is gone.
    #[pg_test]
    fn missed_firings_catch_up_as_asked_and_a_pause_skips() {
        set_scope("t-schedules-missed", "w");
        Spi::run(
            "SELECT ledger.set_schedule('latest', '*/10 * * * *', 'a'); \
             SELECT ledger.set_schedule('all', '*/10 * * * *', 'b', catch_up => 'all')",
        )
        .unwrap();
        // Three firings were missed.
        elapse("latest", 30);
        elapse("all", 30);
        assert_eq!(one::<i32>("SELECT ledger.fire_schedules()"), 4);
        assert_eq!(
            text("SELECT string_agg(mode || ':' || n, ' ' ORDER BY mode) FROM (SELECT mode, count(*) n FROM ledger.runs GROUP BY mode) x"),
            "a:1 b:3"
        );
        assert_eq!(
            text(
                "SELECT ((SELECT max(substring(request_id FROM '[0-9]{4}-.*$')) FROM ledger.runs WHERE mode = 'a') = \
                         (SELECT max(substring(request_id FROM '[0-9]{4}-.*$')) FROM ledger.runs WHERE mode = 'b'))::text"
            ),
            "true"
        );
        Spi::run("SELECT ledger.pause_schedule('all', actor => 'ops')").unwrap();
        elapse("all", 30);
        assert_eq!(one::<i32>("SELECT ledger.fire_schedules()"), 0);
        assert_eq!(
            text("SELECT ((ledger.pause_schedule('all', false)).next_fire_at > now())::text"),
            "true"
        );
        assert_eq!(one::<i32>("SELECT ledger.fire_schedules()"), 0);
        assert!(one::<bool>("SELECT ledger.drop_schedule('all')"));
        assert!(!one::<bool>("SELECT ledger.drop_schedule('all')"));
        assert_error(
            "SELECT ledger.pause_schedule('all')",
            "P0002",
            "SCHEDULE_NOT_FOUND",
        );
        assert_eq!(
            text(
                "SELECT string_agg(outcome, ' ' ORDER BY created_at, id) FROM ledger.audit_events \
                  WHERE gateway_type = 'schedule.set' AND payload->>'schedule_id' = 'all'"
            ),
            "set paused resumed dropped"
        );
    }

    /// A time zone moves the firing: 09:00 in Tokyo is 00:00 UTC.
    #[pg_test]
    fn a_schedule_fires_at_its_time_zones_time() {
        set_scope("t-schedules-tz", "w");
        assert_eq!(
            text(
                "SELECT to_char(next_fire_at AT TIME ZONE 'UTC', 'HH24:MI') \
                   FROM ledger.set_schedule('tokyo-9am', '0 9 * * *', 'a', time_zone => 'Asia/Tokyo')"
            ),
            "00:00"
        );
    }

    /// Bad definitions are refused with their codes and write nothing.
    #[pg_test]
    fn a_bad_schedule_is_refused_and_writes_nothing() {
        set_scope("t-schedules-refused", "w");
        for (query, code) in [
            (
                "SELECT ledger.set_schedule('s', '61 * * * *', 'a')",
                "CRON_INVALID",
            ),
            (
                "SELECT ledger.set_schedule('s', 'every minute', 'a')",
                "CRON_INVALID",
            ),
            (
                "SELECT ledger.set_schedule('s', '* * * * *', 'a', time_zone => 'Mars/Olympus')",
                "TIME_ZONE_UNKNOWN",
            ),
            (
                "SELECT ledger.set_schedule('s', '* * * * *', 'a', catch_up => 'none')",
                "CATCH_UP_UNKNOWN",
            ),
            (
                "SELECT ledger.set_schedule('s', '* * * * *', 'a', priority => 5000)",
                "PRIORITY_INVALID",
            ),
            (
                "SELECT ledger.set_schedule('s', '* * * * *', 'a', inputs => '[1]')",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.set_schedule('s', NULL, 'a')",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.set_schedule('s', '* * * * *', NULL)",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.set_schedule(NULL, '* * * * *', 'a')",
                "ARGUMENT_REQUIRED",
            ),
        ] {
            assert_error(query, "22023", code);
        }
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.schedules"), 0);
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.audit_events"), 0);
    }
}
