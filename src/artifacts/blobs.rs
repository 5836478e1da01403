//! The per-scope content-addressed blob store: large run inputs and artifacts' bytes, each kept
//! once per scope under its sha256.

use crate::db;
use crate::error::{Code, LedgerError, Result};
use crate::scope::Scope;
use ledger_model::hash;

/// Stores `bytes` in the scope's content-addressed blob store; returns their sha256.
pub fn put(scope: &Scope, bytes: &[u8]) -> Result<String> {
    let sha = hash::sha256_hex(bytes);
    lock_for_writing(scope)?;
    db::execute(
        "INSERT INTO ledger.blobs (tenant_id, workspace_id, sha256, size_bytes, content) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        &scope.args([
            sha.as_str().into(),
            (bytes.len() as i64).into(),
            bytes.into(),
        ]),
    )?;
    Ok(sha)
}

/// Loads a blob and checks it against its address (XX001 with `mismatch_code`, which names what
/// the caller was reading).
pub fn get(scope: &Scope, sha256: &str, mismatch_code: Code) -> Result<Vec<u8>> {
    let content = db::select_one(
        "SELECT content FROM ledger.blobs \
          WHERE tenant_id = $1 AND workspace_id = $2 AND sha256 = $3",
        &scope.args([sha256.into()]),
        |r| db::req::<Vec<u8>>(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found(Code::BlobNotFound, "blob", sha256))?;
    let actual = hash::sha256_hex(&content);
    if actual != sha256 {
        return Err(
            LedgerError::new(mismatch_code, "stored bytes do not match their sha256")
                .with("expected", sha256)
                .with("actual", actual),
        );
    }
    Ok(content)
}

/// Takes the scope's blob lock as a writer: shared with other writers, exclusive of the purge's
/// sweep, so a blob this transaction is about to reference cannot be swept before it commits. The
/// lock is the scope's row of `ledger.blob_locks`, on which no role but the functions' owner has
/// any privilege: no one else can take it to block the scope's writers, or see it.
fn lock_for_writing(scope: &Scope) -> Result<()> {
    const LOCK: &str =
        "SELECT 1 FROM ledger.blob_locks WHERE tenant_id = $1 AND workspace_id = $2 \
                        FOR KEY SHARE";
    if db::write_one(LOCK, &scope.args([]), |_| Ok(()))?.is_some() {
        return Ok(());
    }
    // The scope's first blob: its row, then the lock (a concurrent first writer may insert it).
    db::execute(
        "INSERT INTO ledger.blob_locks (tenant_id, workspace_id) VALUES ($1, $2) \
         ON CONFLICT DO NOTHING",
        &scope.args([]),
    )?;
    db::execute(LOCK, &scope.args([]))
}

/// Takes the scope's blob lock for the sweep, only if no writer holds it: false means a blob
/// writer is in flight, and the sweep is left for the next purge rather than waited for. A scope
/// without the row has no blobs (a writer commits it with its first blob).
pub fn try_lock_for_sweep(scope: &Scope) -> Result<bool> {
    Ok(db::write_one(
        "SELECT 1 FROM ledger.blob_locks WHERE tenant_id = $1 AND workspace_id = $2 \
            FOR UPDATE SKIP LOCKED",
        &scope.args([]),
        |_| Ok(()),
    )?
    .is_some())
}
