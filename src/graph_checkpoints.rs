//! Graph checkpoints: a graph framework's saved state (LangGraph's `BaseCheckpointSaver`) in the
//! ledger, per thread and namespace, each checkpoint tied to the ledger run of the invocation
//! that wrote it. Channel values and pending writes are the framework serializer's opaque bytes,
//! stored and returned as given; the metadata is redacted like every JSON argument.

use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::jsonb::Jsonb;
use crate::redaction::redacted_object;
use crate::rows;
use crate::scope::{self, Scope};
use ledger_model::args::{optional_label, required_id, required_label};
use ledger_model::graph_checkpoints::{check_namespace, check_parallel, Strategy};
use pgrx::datum::{Array, DatumWithOid};
use pgrx::prelude::*;

type Names = Option<Vec<Option<String>>>;
/// bytea[] arguments as PostgreSQL holds them (pgrx has no owned form of a bytea array). The
/// functions spell both types out: pgrx sees through no alias to find an `Option` (not STRICT).
type Blobs<'a> = Option<Array<'a, &'a [u8]>>;

/// A bytea[] argument passed on to a statement (NULL was refused before, as an empty list).
fn blobs_arg(blobs: Blobs<'_>) -> DatumWithOid<'_> {
    match blobs {
        Some(b) => b.into(),
        None => Vec::<Option<Vec<u8>>>::new().into(),
    }
}

/// A bytea[] column, copied out of the row.
fn owned_blobs(row: &db::Row, ordinal: usize) -> Result<Vec<Option<Vec<u8>>>> {
    Ok(db::req::<Array<&[u8]>>(row, ordinal)?
        .iter()
        .map(|b| b.map(<[u8]>::to_vec))
        .collect())
}

/// The names of a list argument, checked for NULLs by `check_parallel` first.
fn names(list: Names) -> Vec<String> {
    list.unwrap_or_default().into_iter().flatten().collect()
}

/// Removes the channel values of `threads` that no checkpoint of their thread and namespace
/// names any more (after checkpoints went). The names are gathered once and anti-joined: a
/// lookup per value would read every checkpoint of the thread again for each value.
fn sweep_blobs(scope: &Scope, threads: Vec<String>) -> Result<()> {
    db::execute(
        "WITH named AS MATERIALIZED ( \
           SELECT c.thread_id, c.checkpoint_ns, v.channel, v.version FROM ledger.graph_checkpoints c \
            CROSS JOIN LATERAL jsonb_each_text(CASE jsonb_typeof(c.checkpoint->'channel_versions') \
                                 WHEN 'object' THEN c.checkpoint->'channel_versions' ELSE '{}' END) \
                  AS v (channel, version) \
            WHERE c.tenant_id = $1 AND c.workspace_id = $2 AND c.thread_id = ANY($3)) \
         DELETE FROM ledger.graph_checkpoint_blobs b \
          WHERE b.tenant_id = $1 AND b.workspace_id = $2 AND b.thread_id = ANY($3) \
            AND NOT EXISTS (SELECT 1 FROM named n \
                             WHERE n.thread_id = b.thread_id AND n.checkpoint_ns = b.checkpoint_ns \
                               AND n.channel = b.channel AND n.version = b.version)",
        &scope.args([threads.into()]),
    )
}

/// Deletes the checkpoints a statement selects (`$3` its argument) with their writes, then the
/// values no remaining checkpoint names; returns how many checkpoints went.
fn delete_where(scope: &Scope, condition: &str, argument: DatumWithOid) -> Result<i32> {
    let (count, threads) = db::write_one(
        &format!(
            "WITH gone AS (DELETE FROM ledger.graph_checkpoints c \
                            WHERE c.tenant_id = $1 AND c.workspace_id = $2 AND ({condition}) \
                           RETURNING c.thread_id, c.checkpoint_ns, c.checkpoint_id), \
                  writes AS (DELETE FROM ledger.graph_checkpoint_writes w USING gone g \
                              WHERE w.tenant_id = $1 AND w.workspace_id = $2 AND w.thread_id = g.thread_id \
                                AND w.checkpoint_ns = g.checkpoint_ns AND w.checkpoint_id = g.checkpoint_id) \
             SELECT count(*)::int, coalesce(array_agg(DISTINCT thread_id), '{{}}') FROM gone"
        ),
        &scope.args([argument]),
        |r| Ok((db::req::<i32>(r, 1)?, db::req::<Vec<String>>(r, 2)?)),
    )?
    .unwrap_or_default();
    if count > 0 {
        sweep_blobs(scope, threads)?;
    }
    Ok(count)
}

/// The checkpoints of the runs `run_ids` (ledger run ids), for `purge_runs`.
pub fn delete_for_purged_runs(scope: &Scope, run_ids: &[String]) -> Result<i32> {
    delete_where(scope, "c.run_id = ANY($3)", run_ids.to_vec().into())
}

/// Stores a checkpoint of thread `thread_id` written by the run `run_id`, with the channel values
/// it introduces (one entry per channel: its version, the serializer's type and bytes). A
/// checkpoint stored again (same thread, namespace and id) gets the new checkpoint and metadata.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_graph_checkpoints"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn put_graph_checkpoint<'a>(
    run_id: Option<&str>,
    thread_id: Option<&str>,
    checkpoint_ns: Option<&str>,
    checkpoint_id: Option<&str>,
    checkpoint: Option<Jsonb>,
    metadata: default!(Option<Jsonb>, "NULL"),
    parent_checkpoint_id: default!(Option<&str>, "NULL"),
    channels: default!(Option<Vec<Option<String>>>, "'{}'"),
    versions: default!(Option<Vec<Option<String>>>, "'{}'"),
    blob_types: default!(Option<Vec<Option<String>>>, "'{}'"),
    blobs: default!(Option<Array<'a, &'a [u8]>>, "'{}'"),
) -> std::result::Result<(), SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let thread_id = required_label("thread_id", thread_id)?;
    let checkpoint_ns = check_namespace("checkpoint_ns", checkpoint_ns)?;
    let checkpoint_id = required_label("checkpoint_id", checkpoint_id)?;
    let parent = optional_label("parent_checkpoint_id", parent_checkpoint_id)?;
    let checkpoint = checkpoint.ok_or_else(|| LedgerError::required("checkpoint"))?;
    if !checkpoint.is_object() {
        raise(
            LedgerError::new(Code::ArgumentNotObject, "checkpoint must be a JSON object")
                .with("argument", "checkpoint"),
        );
    }
    let metadata = Jsonb::from(&redacted_object("metadata", metadata)?);
    check_parallel(
        &[
            ("channels", channels.as_ref().map(Vec::len)),
            ("versions", versions.as_ref().map(Vec::len)),
            ("blob_types", blob_types.as_ref().map(Vec::len)),
            ("blobs", blobs.as_ref().map(Array::len)),
        ],
        &[
            ("channels", channels.as_deref().unwrap_or_default()),
            ("versions", versions.as_deref().unwrap_or_default()),
            ("blob_types", blob_types.as_deref().unwrap_or_default()),
        ],
    )?;
    // Kept from a purge until this transaction ends (a purge racing it ends in RUN_NOT_FOUND).
    rows::referenced_run(&scope, "run_id", run_id)?;
    let place = || [thread_id.into(), checkpoint_ns.as_str().into()];
    db::execute(
        "INSERT INTO ledger.graph_checkpoint_blobs \
                (tenant_id, workspace_id, thread_id, checkpoint_ns, channel, version, blob_type, blob) \
         SELECT $1, $2, $3, $4, u.channel, u.version, u.blob_type, u.blob \
           FROM unnest($5::text[], $6::text[], $7::text[], $8::bytea[]) AS u (channel, version, blob_type, blob) \
         ON CONFLICT DO NOTHING",
        &scope.args(place().into_iter().chain([
            names(channels).into(),
            names(versions).into(),
            names(blob_types).into(),
            blobs_arg(blobs),
        ])),
    )?;
    db::execute(
        "INSERT INTO ledger.graph_checkpoints AS c \
                (tenant_id, workspace_id, thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, \
                 run_id, checkpoint, metadata) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
         ON CONFLICT (tenant_id, workspace_id, thread_id, checkpoint_ns, checkpoint_id) \
         DO UPDATE SET checkpoint = EXCLUDED.checkpoint, metadata = EXCLUDED.metadata",
        &scope.args(place().into_iter().chain([
            checkpoint_id.into(),
            parent.into(),
            run_id.into(),
            checkpoint.into(),
            metadata.into(),
        ])),
    )?;
    Ok(())
}

/// Stores pending writes of task `task_id` against a checkpoint (LangGraph may store them before
/// the checkpoint itself, concurrently): entry i is write number
/// `idxs[i]` to `channels[i]` (the serializer's type and bytes). A write already stored is kept,
/// or replaced with `upsert` (LangGraph's special channels: errors, interrupts). Returns how many
/// writes were stored.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_graph_checkpoints"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn put_graph_checkpoint_writes<'a>(
    thread_id: Option<&str>,
    checkpoint_ns: Option<&str>,
    checkpoint_id: Option<&str>,
    task_id: Option<&str>,
    idxs: Option<Vec<Option<i32>>>,
    channels: Option<Vec<Option<String>>>,
    blob_types: Option<Vec<Option<String>>>,
    blobs: Option<Array<'a, &'a [u8]>>,
    task_path: default!(Option<&str>, "''"),
    upsert: default!(Option<bool>, false),
) -> std::result::Result<i32, SqlError> {
    let scope = scope::current()?;
    let thread_id = required_label("thread_id", thread_id)?;
    let checkpoint_ns = check_namespace("checkpoint_ns", checkpoint_ns)?;
    let checkpoint_id = required_label("checkpoint_id", checkpoint_id)?;
    let task_id = required_label("task_id", task_id)?;
    let task_path = check_namespace("task_path", task_path)?;
    let upsert = upsert.ok_or_else(|| LedgerError::required("upsert"))?;
    let idx_names: Vec<Option<String>> = idxs
        .iter()
        .flatten()
        .map(|i| i.map(|i| i.to_string()))
        .collect();
    check_parallel(
        &[
            ("idxs", idxs.as_ref().map(Vec::len)),
            ("channels", channels.as_ref().map(Vec::len)),
            ("blob_types", blob_types.as_ref().map(Vec::len)),
            ("blobs", blobs.as_ref().map(Array::len)),
        ],
        &[
            ("idxs", &idx_names),
            ("channels", channels.as_deref().unwrap_or_default()),
            ("blob_types", blob_types.as_deref().unwrap_or_default()),
        ],
    )?;
    let place = || {
        [
            thread_id.into(),
            checkpoint_ns.as_str().into(),
            checkpoint_id.into(),
        ]
    };
    let on_conflict = if upsert {
        "DO UPDATE SET channel = EXCLUDED.channel, blob_type = EXCLUDED.blob_type, \
                       blob = EXCLUDED.blob, task_path = EXCLUDED.task_path"
    } else {
        "DO NOTHING"
    };
    let idxs: Vec<i32> = idxs.unwrap_or_default().into_iter().flatten().collect();
    let stored = db::write_one(
        &format!(
            "WITH stored AS ( \
               INSERT INTO ledger.graph_checkpoint_writes \
                      (tenant_id, workspace_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx, \
                       channel, blob_type, blob, task_path) \
               SELECT $1, $2, $3, $4, $5, $6, u.idx, u.channel, u.blob_type, u.blob, $7 \
                 FROM unnest($8::int[], $9::text[], $10::text[], $11::bytea[]) AS u (idx, channel, blob_type, blob) \
               ON CONFLICT (tenant_id, workspace_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx) \
               {on_conflict} RETURNING 1) \
             SELECT count(*)::int FROM stored"
        ),
        &scope.args(place().into_iter().chain([
            task_id.into(),
            task_path.as_str().into(),
            idxs.into(),
            names(channels).into(),
            names(blob_types).into(),
            blobs_arg(blobs),
        ])),
        |r| db::req::<i32>(r, 1),
    )?;
    Ok(stored.unwrap_or(0))
}

/// The checkpoints of the scope, newest first (by checkpoint id), each with the channel values
/// its `channel_versions` name and its pending writes: those of one thread, namespace or
/// checkpoint when given, whose metadata contains `filter`, older than `before`, at most
/// `max_checkpoints`.
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema", "ledger_graph_checkpoints"])]
#[search_path(pg_catalog, ledger, pg_temp)]
#[allow(clippy::type_complexity)]
fn graph_checkpoint_tuples(
    thread_id: default!(Option<&str>, "NULL"),
    checkpoint_ns: default!(Option<&str>, "NULL"),
    checkpoint_id: default!(Option<&str>, "NULL"),
    filter: default!(Option<Jsonb>, "NULL"),
    before: default!(Option<&str>, "NULL"),
    max_checkpoints: default!(Option<i32>, "NULL"),
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(thread_id, String),
            name!(checkpoint_ns, String),
            name!(checkpoint_id, String),
            name!(parent_checkpoint_id, Option<String>),
            name!(run_id, String),
            name!(checkpoint, Jsonb),
            name!(metadata, Jsonb),
            name!(channels, Vec<String>),
            name!(blob_types, Vec<String>),
            name!(blobs, Vec<Option<Vec<u8>>>),
            name!(write_task_ids, Vec<String>),
            name!(write_channels, Vec<String>),
            name!(write_blob_types, Vec<String>),
            name!(write_blobs, Vec<Option<Vec<u8>>>),
            name!(write_task_paths, Vec<String>),
        ),
    >,
    SqlError,
> {
    let scope = scope::current()?;
    optional_label("thread_id", thread_id)?;
    check_namespace("checkpoint_ns", checkpoint_ns)?;
    optional_label("checkpoint_id", checkpoint_id)?;
    optional_label("before", before)?;
    if let Some(f) = &filter {
        if !f.is_object() {
            raise(
                LedgerError::new(Code::ArgumentNotObject, "filter must be a JSON object")
                    .with("argument", "filter"),
            );
        }
    }
    if max_checkpoints.is_some_and(|n| n < 1) {
        raise(
            LedgerError::new(Code::LimitInvalid, "max_checkpoints must be at least 1")
                .with("max_checkpoints", max_checkpoints),
        );
    }
    let rows = db::select(
        include_str!("../sql/queries/graph_checkpoint_tuples.sql"),
        &scope.args([
            thread_id.into(),
            checkpoint_ns.into(),
            checkpoint_id.into(),
            filter.into(),
            before.into(),
            max_checkpoints.into(),
        ]),
        |r| {
            Ok((
                db::req(r, 1)?,
                db::req(r, 2)?,
                db::req(r, 3)?,
                db::opt(r, 4)?,
                db::req(r, 5)?,
                db::req(r, 6)?,
                db::req(r, 7)?,
                db::req(r, 8)?,
                db::req(r, 9)?,
                owned_blobs(r, 10)?,
                db::req(r, 11)?,
                db::req(r, 12)?,
                db::req(r, 13)?,
                owned_blobs(r, 14)?,
                db::req(r, 15)?,
            ))
        },
    )?;
    Ok(TableIterator::new(rows))
}

/// Deletes every checkpoint, pending write and channel value of the thread, in every namespace;
/// returns how many checkpoints went.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_graph_checkpoints"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn delete_graph_thread(thread_id: Option<&str>) -> std::result::Result<i32, SqlError> {
    let scope = scope::current()?;
    let thread_id = required_label("thread_id", thread_id)?;
    let deleted = delete_where(&scope, "c.thread_id = $3", thread_id.into())?;
    // Writes whose checkpoint never came (their process died first) go with the thread.
    db::execute(
        "DELETE FROM ledger.graph_checkpoint_writes \
          WHERE tenant_id = $1 AND workspace_id = $2 AND thread_id = $3",
        &scope.args([thread_id.into()]),
    )?;
    Ok(deleted)
}

/// Copies every checkpoint of `source_thread_id` (every namespace, with its pending writes and
/// channel values, each still tied to the run that wrote it) to `target_thread_id`; checkpoints
/// the target already has are kept. Returns how many checkpoints were copied.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_graph_checkpoints"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn copy_graph_thread(
    source_thread_id: Option<&str>,
    target_thread_id: Option<&str>,
) -> std::result::Result<i32, SqlError> {
    let scope = scope::current()?;
    let source = required_label("source_thread_id", source_thread_id)?;
    let target = required_label("target_thread_id", target_thread_id)?;
    let args = || scope.args([source.into(), target.into()]);
    let copied = db::write_one(
        "WITH copied AS ( \
           INSERT INTO ledger.graph_checkpoints \
                  (tenant_id, workspace_id, thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, \
                   run_id, checkpoint, metadata) \
           SELECT tenant_id, workspace_id, $4, checkpoint_ns, checkpoint_id, parent_checkpoint_id, \
                  run_id, checkpoint, metadata \
             FROM ledger.graph_checkpoints WHERE tenant_id = $1 AND workspace_id = $2 AND thread_id = $3 \
           ON CONFLICT DO NOTHING RETURNING 1) \
         SELECT count(*)::int FROM copied",
        &args(),
        |r| db::req::<i32>(r, 1),
    )?
    .unwrap_or(0);
    db::execute(
        "INSERT INTO ledger.graph_checkpoint_blobs \
                (tenant_id, workspace_id, thread_id, checkpoint_ns, channel, version, blob_type, blob) \
         SELECT tenant_id, workspace_id, $4, checkpoint_ns, channel, version, blob_type, blob \
           FROM ledger.graph_checkpoint_blobs WHERE tenant_id = $1 AND workspace_id = $2 AND thread_id = $3 \
         ON CONFLICT DO NOTHING",
        &args(),
    )?;
    db::execute(
        "INSERT INTO ledger.graph_checkpoint_writes \
                (tenant_id, workspace_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx, \
                 channel, blob_type, blob, task_path) \
         SELECT tenant_id, workspace_id, $4, checkpoint_ns, checkpoint_id, task_id, idx, \
                channel, blob_type, blob, task_path \
           FROM ledger.graph_checkpoint_writes WHERE tenant_id = $1 AND workspace_id = $2 AND thread_id = $3 \
         ON CONFLICT DO NOTHING",
        &args(),
    )?;
    Ok(copied)
}

/// Prunes the threads `thread_ids`: `keep_latest` keeps the newest checkpoint of each namespace
/// (with its writes and the values it names), `delete` removes everything. Returns how many
/// checkpoints went.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_graph_checkpoints"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn prune_graph_threads(
    thread_ids: Option<Vec<Option<String>>>,
    strategy: default!(Option<&str>, "'keep_latest'"),
) -> std::result::Result<i32, SqlError> {
    let scope = scope::current()?;
    let strategy = Strategy::parse(strategy)?;
    let thread_ids = thread_ids.ok_or_else(|| LedgerError::required("thread_ids"))?;
    let thread_ids = thread_ids
        .into_iter()
        .map(|t| required_label("thread_ids", t.as_deref()).map(str::to_owned))
        .collect::<Result<Vec<_>>>()?;
    let condition = match strategy {
        Strategy::Delete => "c.thread_id = ANY($3)",
        Strategy::KeepLatest => {
            "c.thread_id = ANY($3) AND c.checkpoint_id < ( \
               SELECT max(k.checkpoint_id) FROM ledger.graph_checkpoints k \
                WHERE k.tenant_id = c.tenant_id AND k.workspace_id = c.workspace_id \
                  AND k.thread_id = c.thread_id AND k.checkpoint_ns = c.checkpoint_ns)"
        }
    };
    Ok(delete_where(&scope, condition, thread_ids.into())?)
}

/// Deletes the checkpoints (with their pending writes, and the values no remaining checkpoint
/// names) written by the runs `run_ids`: ledger run ids, or the framework's own run ids as its
/// metadata holds them (`metadata->>'run_id'`). The runs themselves stay. Returns how many
/// checkpoints went.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_graph_checkpoints"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn delete_graph_checkpoints_for_runs(
    run_ids: Option<Vec<Option<String>>>,
) -> std::result::Result<i32, SqlError> {
    let scope = scope::current()?;
    let run_ids = run_ids.ok_or_else(|| LedgerError::required("run_ids"))?;
    let run_ids = run_ids
        .into_iter()
        .map(|r| required_label("run_ids", r.as_deref()).map(str::to_owned))
        .collect::<Result<Vec<_>>>()?;
    Ok(delete_where(
        &scope,
        "c.run_id = ANY($3) OR c.metadata->>'run_id' = ANY($3)",
        run_ids.into(),
    )?)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn run_sql(sql: &str) {
        Spi::run(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Checkpoint `id` of thread `thread` by run `run`, naming channel `a` at `version` (stored
    /// with it when `new`).
    fn put(run: &str, thread: &str, id: &str, version: &str, new: bool) {
        let values = if new {
            format!(", channels => '{{a}}', versions => '{{{version}}}', blob_types => '{{bytes}}', blobs => ARRAY['\\x{version}0'::bytea]")
        } else {
            String::new()
        };
        run_sql(&format!(
            "SELECT ledger.put_graph_checkpoint('{run}', '{thread}', '', '{id}', \
             '{{\"channel_versions\": {{\"a\": \"{version}\"}}}}', '{{\"password\": \"p\"}}'{values})"
        ));
    }

    fn count(table: &str) -> i64 {
        one::<i64>(&format!("SELECT count(*) FROM ledger.{table}"))
    }

    #[pg_test]
    fn a_purged_run_takes_its_checkpoints_writes_and_unnamed_values() {
        set_scope("t-graph-purge", "w");
        for run in ["old", "new"] {
            run_sql(&format!(
                "SELECT ledger.create_run('agent', run_id => '{run}')"
            ));
        }
        put("old", "th", "c1", "1", true);
        put("old", "th", "c2", "2", true);
        run_sql("SELECT ledger.put_graph_checkpoint_writes('th', '', 'c2', 'task', '{0}', '{a}', '{bytes}', ARRAY['\\x01'::bytea])");
        // The new run's checkpoint still names version 2, stored with the old run's c2.
        put("new", "th", "c3", "2", false);
        assert_eq!(
            one::<String>("SELECT metadata->>'password' FROM ledger.graph_checkpoints WHERE checkpoint_id = 'c1'"),
            "[REDACTED]"
        );
        for run in ["old", "new"] {
            run_sql(&format!(
                "SELECT ledger.transition_run('{run}', 'canceled')"
            ));
        }
        run_sql("UPDATE ledger.runs SET ended_at = now() - interval '40 days' WHERE id = 'old'");
        assert_eq!(one::<i32>("SELECT ledger.purge_runs('30 days')"), 1);
        assert_eq!(
            one::<String>("SELECT string_agg(checkpoint_id, ',') FROM ledger.graph_checkpoints"),
            "c3"
        );
        assert_eq!(count("graph_checkpoint_writes"), 0);
        // Version 1 went with c1; version 2 stays, c3 names it.
        assert_eq!(
            one::<String>("SELECT string_agg(version, ',') FROM ledger.graph_checkpoint_blobs"),
            "2"
        );
        assert_eq!(
            one::<Vec<u8>>("SELECT blobs[1] FROM ledger.graph_checkpoint_tuples('th')"),
            vec![0x20]
        );
    }

    #[pg_test]
    fn bad_arguments_are_refused_and_nothing_is_written() {
        set_scope("t-graph-args", "w");
        run_sql("SELECT ledger.create_run('agent', run_id => 'r')");
        let put = "SELECT ledger.put_graph_checkpoint";
        for (sql, state, code) in [
            (format!("{put}('nope', 't', '', 'c', '{{}}')"), "P0002", "RUN_NOT_FOUND"),
            (format!("{put}(NULL, 't', '', 'c', '{{}}')"), "22023", "ARGUMENT_REQUIRED"),
            (format!("{put}('r', NULL, '', 'c', '{{}}')"), "22023", "ARGUMENT_REQUIRED"),
            (format!("{put}('r', 't', '', NULL, '{{}}')"), "22023", "ARGUMENT_REQUIRED"),
            (format!("{put}('r', 't', E'a\\nb', 'c', '{{}}')"), "22023", "LABEL_INVALID"),
            (format!("{put}('r', 't', '', 'c', NULL)"), "22023", "ARGUMENT_REQUIRED"),
            (format!("{put}('r', 't', '', 'c', '[]')"), "22023", "ARGUMENT_NOT_OBJECT"),
            (format!("{put}('r', 't', '', 'c', '{{}}', '1')"), "22023", "ARGUMENT_NOT_OBJECT"),
            (format!("{put}('r', 't', '', 'c', '{{}}', channels => '{{a}}')"), "22023", "GRAPH_BLOBS_INVALID"),
            (format!("{put}('r', 't', '', 'c', '{{}}', channels => ARRAY[NULL], versions => '{{1}}', blob_types => '{{b}}', blobs => ARRAY[NULL::bytea])"), "22023", "GRAPH_BLOBS_INVALID"),
            (format!("{put}('r', 't', '', 'c', '{{}}', blobs => NULL)"), "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.put_graph_checkpoint_writes('t', '', 'c', 'k', '{0,1}', '{a}', '{b}', ARRAY[NULL::bytea])".to_owned(), "22023", "GRAPH_BLOBS_INVALID"),
            ("SELECT ledger.put_graph_checkpoint_writes('t', '', 'c', 'k', NULL, '{a}', '{b}', ARRAY[NULL::bytea])".to_owned(), "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.prune_graph_threads('{t}', 'all')".to_owned(), "22023", "STRATEGY_UNKNOWN"),
            ("SELECT ledger.prune_graph_threads(NULL)".to_owned(), "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.delete_graph_checkpoints_for_runs(NULL)".to_owned(), "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.delete_graph_checkpoints_for_runs(ARRAY[NULL])".to_owned(), "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.delete_graph_thread(NULL)".to_owned(), "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.copy_graph_thread('a', NULL)".to_owned(), "22023", "ARGUMENT_REQUIRED"),
            ("SELECT * FROM ledger.graph_checkpoint_tuples(filter => '[1]')".to_owned(), "22023", "ARGUMENT_NOT_OBJECT"),
            ("SELECT * FROM ledger.graph_checkpoint_tuples(max_checkpoints => 0)".to_owned(), "22023", "LIMIT_INVALID"),
        ] {
            assert_error(&sql, state, code);
        }
        assert_eq!(
            count("graph_checkpoints") + count("graph_checkpoint_blobs"),
            0
        );
        Spi::run("SELECT set_config('ledger.tenant_id', '', true)").unwrap();
        assert_error(
            "SELECT * FROM ledger.graph_checkpoint_tuples()",
            "42501",
            "SCOPE_MISSING",
        );
    }

    #[pg_test]
    fn another_scope_sees_nothing_and_a_reader_cannot_write_under_any_role() {
        set_scope("t-graph-a", "w");
        run_sql("SELECT ledger.create_run('agent', run_id => 'r')");
        put("r", "th", "c1", "1", true);
        Spi::run("SET LOCAL ROLE ledger_reader").unwrap();
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.graph_checkpoint_tuples('th')"),
            1
        );
        assert_eq!(
            crate::testing::error_of("SELECT ledger.delete_graph_thread('th')").sqlstate,
            "42501"
        );
        Spi::run("RESET ROLE").unwrap();
        // Another scope, as a writer and as an operator, through the functions and plain SQL.
        set_scope("t-graph-b", "w");
        for role in ["ledger_writer", "ledger_operator"] {
            Spi::run(&format!("SET LOCAL ROLE {role}")).unwrap();
            assert_eq!(
                one::<i64>("SELECT count(*) FROM ledger.graph_checkpoint_tuples('th')"),
                0
            );
            assert_eq!(one::<i32>("SELECT ledger.delete_graph_thread('th')"), 0);
            assert_eq!(
                one::<i32>("SELECT ledger.prune_graph_threads('{th}', 'delete')"),
                0
            );
            for table in [
                "graph_checkpoints",
                "graph_checkpoint_blobs",
                "graph_checkpoint_writes",
            ] {
                assert_eq!(count(table), 0, "{role}: {table}");
            }
            Spi::run("RESET ROLE").unwrap();
        }
        // A role without a ledger grant reads nothing at all.
        Spi::run("CREATE ROLE ledger_graph_nobody; SET LOCAL ROLE ledger_graph_nobody").unwrap();
        for sql in [
            "SELECT count(*) FROM ledger.graph_checkpoints",
            "SELECT count(*) FROM ledger.graph_checkpoint_tuples('th')",
        ] {
            assert_eq!(crate::testing::error_of(sql).sqlstate, "42501", "{sql}");
        }
        Spi::run("RESET ROLE").unwrap();
        set_scope("t-graph-a", "w");
        assert_eq!(count("graph_checkpoint_blobs"), 1);
    }
}
