//! Artifacts of a run: bytes in the scope's blob store, or a pointer to an external store.

use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::redaction::redacted_object;
use crate::rows::{self, HeldRun, LockedRun};
use crate::scope::{self, Scope};
use ledger_model::args::{optional_label, required, required_id};
use ledger_model::events::{ArtifactCreated, Event};
use ledger_model::ids;
use pgrx::prelude::*;

pub mod blobs;

/// The storage key of bytes held in `ledger.blobs`.
const BLOB_KEY_PREFIX: &str = "blob:sha256:";

/// What a new artifact row holds: `run` is the run it belongs to, held by this transaction.
pub struct NewArtifact<'a> {
    pub run: HeldRun<'a>,
    pub step_id: Option<&'a str>,
    pub artifact_type: &'a str,
    pub mime: Option<&'a str>,
    pub size_bytes: i64,
    pub sha256: &'a str,
    pub storage_key: &'a str,
    pub meta: &'a serde_json::Value,
}

/// Inserts the artifact row and its `artifact.created` event; returns its id.
pub fn insert(scope: &Scope, new: &NewArtifact) -> Result<String> {
    let id = ids::new_id("art");
    db::execute(
        include_str!("../sql/queries/insert_artifact.sql"),
        &scope.args([
            id.as_str().into(),
            new.run.id.into(),
            new.step_id.into(),
            new.artifact_type.into(),
            new.mime.into(),
            new.size_bytes.into(),
            new.sha256.into(),
            new.storage_key.into(),
            Jsonb::from(new.meta).into(),
        ]),
    )?;
    let created = Event::ArtifactCreated(ArtifactCreated {
        artifact_id: &id,
        artifact_type: new.artifact_type,
        size_bytes: new.size_bytes,
        sha256: new.sha256,
    });
    feed::append(scope, new.run, new.step_id, &created)?;
    Ok(id)
}

/// Stores `bytes` in the blob store and records them as an artifact; returns (id, sha256).
pub fn put_bytes(
    scope: &Scope,
    run: HeldRun,
    step_id: Option<&str>,
    bytes: &[u8],
    artifact_type: &str,
    mime: Option<&str>,
    meta: &serde_json::Value,
) -> Result<(String, String)> {
    let sha = blobs::put(scope, bytes)?;
    let key = format!("{BLOB_KEY_PREFIX}{sha}");
    let id = insert(
        scope,
        &NewArtifact {
            run,
            step_id,
            artifact_type,
            mime,
            size_bytes: bytes.len() as i64,
            sha256: &sha,
            storage_key: &key,
            meta,
        },
    )?;
    Ok((id, sha))
}

/// An artifact row as the read paths need it.
pub struct Artifact {
    pub run_id: String,
    pub step_id: Option<String>,
    pub sha256: String,
    pub storage_key: String,
}

/// Loads an artifact visible in this scope.
pub fn load(scope: &Scope, artifact_id: &str) -> Result<Option<Artifact>> {
    db::select_one(
        "SELECT run_id, step_id, sha256, storage_key FROM ledger.run_artifacts \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([artifact_id.into()]),
        |r| {
            Ok(Artifact {
                run_id: db::req(r, 1)?,
                step_id: db::opt(r, 2)?,
                sha256: db::req(r, 3)?,
                storage_key: db::req(r, 4)?,
            })
        },
    )
}

/// The bytes of an artifact held in the blob store, verified against the artifact's sha256
/// (XX001 `ARTIFACT_HASH_MISMATCH`).
pub fn bytes(scope: &Scope, artifact_id: &str, artifact: &Artifact) -> Result<Vec<u8>> {
    let Some(address) = artifact.storage_key.strip_prefix(BLOB_KEY_PREFIX) else {
        return Err(LedgerError::new(
            Code::ArtifactExternal,
            "the artifact's bytes live in an external store; read them from its storage_key",
        )
        .with("artifact_id", artifact_id)
        .with("storage_key", artifact.storage_key.as_str()));
    };
    if address != artifact.sha256 {
        return Err(hash_mismatch(artifact_id, &artifact.sha256, address));
    }
    blobs::get(scope, address, Code::ArtifactHashMismatch)
}

pub fn hash_mismatch(artifact_id: &str, expected: &str, actual: &str) -> LedgerError {
    LedgerError::new(
        Code::ArtifactHashMismatch,
        "stored bytes do not match their sha256",
    )
    .with("artifact_id", artifact_id)
    .with("expected", expected)
    .with("actual", actual)
}

fn checked_type<'a>(value: Option<&'a str>, default: &'static str) -> Result<&'a str> {
    let t = value.unwrap_or(default);
    if ["file", "log", "blob", "json"].contains(&t) {
        Ok(t)
    } else {
        Err(LedgerError::new(
            Code::ArtifactTypeUnknown,
            "artifact_type must be file, log, blob or json",
        )
        .with("artifact_type", t))
    }
}

type ArtifactRow = pgrx::composite_type!('static, "ledger.run_artifacts");

fn row(scope: &Scope, id: &str) -> Result<ArtifactRow> {
    rows::scoped_row(
        scope,
        "ledger.run_artifacts",
        id,
        Code::ArtifactNotFound,
        "artifact",
    )
}

/// The arguments `put_artifact` and `register_artifact` share, with the caller's scope.
struct Shared<'a> {
    scope: Scope,
    run_id: &'a str,
    artifact_type: Option<&'a str>,
    mime: Option<&'a str>,
    step_id: Option<&'a str>,
    meta: Option<Jsonb>,
}

impl<'a> Shared<'a> {
    /// Checks only the scope and that the run is named: the rest is checked after each
    /// function's own arguments.
    fn new(
        run_id: Option<&'a str>,
        artifact_type: Option<&'a str>,
        mime: Option<&'a str>,
        step_id: Option<&'a str>,
        meta: Option<Jsonb>,
    ) -> Result<Shared<'a>> {
        Ok(Shared {
            scope: scope::current()?,
            run_id: required_id("run_id", run_id)?,
            artifact_type,
            mime: optional_label("mime", mime)?,
            step_id,
            meta,
        })
    }
}

/// The shared arguments, checked: the type known, the run locked and the step one of its own,
/// the meta redacted.
struct Checked<'a> {
    scope: Scope,
    run: LockedRun,
    artifact_type: &'a str,
    mime: Option<&'a str>,
    step_id: Option<&'a str>,
    meta: serde_json::Value,
}

/// What both ways of recording an artifact do once each has checked its own arguments: checks
/// the shared ones (`default_type` when the type is NULL), `store`s the artifact and returns
/// its row.
fn record(
    shared: Shared,
    default_type: &'static str,
    store: impl FnOnce(&Checked) -> Result<String>,
) -> Result<ArtifactRow> {
    let artifact_type = checked_type(shared.artifact_type, default_type)?;
    let run = rows::lock_owner(&shared.scope, shared.run_id, shared.step_id)?;
    let checked = Checked {
        meta: redacted_object("meta", shared.meta)?,
        scope: shared.scope,
        run,
        artifact_type,
        mime: shared.mime,
        step_id: shared.step_id,
    };
    let id = store(&checked)?;
    row(&checked.scope, &id)
}

/// Stores bytes in the scope's blob store and records them as an artifact of the run.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn put_artifact(
    run_id: Option<&str>,
    content: Option<Vec<u8>>,
    artifact_type: default!(Option<&str>, "'blob'"),
    mime: default!(Option<&str>, "NULL"),
    step_id: default!(Option<&str>, "NULL"),
    meta: default!(Option<Jsonb>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.run_artifacts"), SqlError> {
    let shared = Shared::new(run_id, artifact_type, mime, step_id, meta)?;
    let content = content.ok_or_else(|| LedgerError::required("content"))?;
    Ok(record(shared, "blob", |a| {
        let (id, _) = put_bytes(
            &a.scope,
            a.run.held(),
            a.step_id,
            &content,
            a.artifact_type,
            a.mime,
            &a.meta,
        )?;
        Ok(id)
    })?)
}

/// Records an artifact whose bytes live in an external store.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn register_artifact(
    run_id: Option<&str>,
    storage_key: Option<&str>,
    size_bytes: Option<i64>,
    sha256: Option<&str>,
    artifact_type: default!(Option<&str>, "'file'"),
    mime: default!(Option<&str>, "NULL"),
    step_id: default!(Option<&str>, "NULL"),
    meta: default!(Option<Jsonb>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.run_artifacts"), SqlError> {
    let shared = Shared::new(run_id, artifact_type, mime, step_id, meta)?;
    let storage_key = required("storage_key", storage_key)?;
    ids::validate_storage_key("storage_key", storage_key)?;
    let size_bytes = size_bytes.ok_or_else(|| LedgerError::required("size_bytes"))?;
    if size_bytes < 0 {
        raise(
            LedgerError::new(Code::SizeInvalid, "size_bytes must not be negative")
                .with("size_bytes", size_bytes),
        );
    }
    let sha = required("sha256", sha256)?;
    if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
        raise(LedgerError::new(
            Code::Sha256Invalid,
            "sha256 must be 64 hex digits",
        ));
    }
    let sha = sha.to_ascii_lowercase();
    if storage_key.starts_with(BLOB_KEY_PREFIX) {
        raise(LedgerError::new(
            Code::StorageKeyReserved,
            "blob:sha256: keys are the built-in store's; use ledger.put_artifact",
        ));
    }
    Ok(record(shared, "file", |a| {
        insert(
            &a.scope,
            &NewArtifact {
                run: a.run.held(),
                step_id: a.step_id,
                artifact_type: a.artifact_type,
                mime: a.mime,
                size_bytes,
                sha256: &sha,
                storage_key,
                meta: &a.meta,
            },
        )
    })?)
}

/// The bytes of an artifact in the built-in store, verified against its sha256.
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn get_artifact(artifact_id: Option<&str>) -> std::result::Result<Vec<u8>, SqlError> {
    let scope = scope::current()?;
    let artifact_id = required_id("artifact_id", artifact_id)?;
    ids::validate("artifact_id", artifact_id)?;
    let artifact = load(&scope, artifact_id)?
        .ok_or_else(|| LedgerError::not_found(Code::ArtifactNotFound, "artifact", artifact_id))?;
    Ok(bytes(&scope, artifact_id, &artifact)?)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    #[pg_test]
    fn artifacts_round_trip_and_are_verified() {
        set_scope("t-artifacts", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r')").unwrap();
        let id = one::<String>("SELECT id FROM ledger.put_artifact('r', '\\x00010203'::bytea, 'file', 'application/octet-stream', meta => '{\"name\": \"a.bin\", \"token\": \"t\"}')");
        assert!(id.starts_with("art_"));
        assert_eq!(
            one::<Vec<u8>>(&format!("SELECT ledger.get_artifact('{id}')")),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            one::<String>(&format!("SELECT concat_ws('|', size_bytes, sha256 = encode(sha256('\\x00010203'::bytea), 'hex'), meta->>'token') FROM ledger.run_artifacts WHERE id = '{id}'")),
            "4|t|[REDACTED]"
        );
        // The same bytes again share one blob.
        Spi::run("SELECT ledger.put_artifact('r', '\\x00010203'::bytea)").unwrap();
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.blobs"), 1);
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.run_events WHERE event_type = 'artifact.created'"
            ),
            2
        );

        let ext = one::<String>(&format!(
            "SELECT id FROM ledger.register_artifact('r', 's3://bucket/a.pdf', 10, '{}')",
            "AB".repeat(32)
        ));
        assert_eq!(
            one::<String>(&format!(
                "SELECT sha256 FROM ledger.run_artifacts WHERE id = '{ext}'"
            )),
            "ab".repeat(32)
        );
        assert_error(
            &format!("SELECT ledger.get_artifact('{ext}')"),
            "55000",
            "ARTIFACT_EXTERNAL",
        );

        Spi::run(
            "UPDATE ledger.blobs SET content = '\\x09'::bytea WHERE tenant_id = 't-artifacts'",
        )
        .unwrap();
        assert_error(
            &format!("SELECT ledger.get_artifact('{id}')"),
            "XX001",
            "ARTIFACT_HASH_MISMATCH",
        );
    }

    #[pg_test]
    fn bad_artifacts_are_refused() {
        set_scope("t-artifacts-bad", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r')").unwrap();
        for (sql, state, code) in [
            (
                "SELECT ledger.put_artifact('r', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.put_artifact('r', '\\x00', 'video')",
                "22023",
                "ARTIFACT_TYPE_UNKNOWN",
            ),
            (
                "SELECT ledger.put_artifact('r', '\\x00', meta => '[1]')",
                "22023",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.put_artifact('nope', '\\x00')",
                "P0002",
                "RUN_NOT_FOUND",
            ),
            (
                "SELECT ledger.put_artifact('r', '\\x00', step_id => 'nope')",
                "P0002",
                "STEP_NOT_FOUND",
            ),
            (
                "SELECT ledger.register_artifact('r', 's3://x', 1, 'abc')",
                "22023",
                "SHA256_INVALID",
            ),
            (
                "SELECT ledger.register_artifact('r', 's3://x', -1, 'abc')",
                "22023",
                "SIZE_INVALID",
            ),
            (
                "SELECT ledger.get_artifact('art_nope')",
                "P0002",
                "ARTIFACT_NOT_FOUND",
            ),
        ] {
            assert_error(sql, state, code);
        }
        let reserved = format!(
            "SELECT ledger.register_artifact('r', 'blob:sha256:{0}', 1, '{0}')",
            "a".repeat(64)
        );
        assert_error(&reserved, "22023", "STORAGE_KEY_RESERVED");
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_artifacts"), 0);
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.blobs"), 0);
    }
}
