//! The per-scope content-addressed blob store: large run inputs and artifacts' bytes, each kept
//! once per scope under its sha256.

use crate::db;
use crate::error::{Class, LedgerError, Result};
use crate::model::hash;
use crate::scope::Scope;

/// Stores `bytes` in the scope's content-addressed blob store; returns their sha256.
pub fn put(scope: &Scope, bytes: &[u8]) -> Result<String> {
    let sha = hash::sha256_hex(bytes);
    // Shared with other writers, exclusive for the purge's sweep of unreferenced blobs: a blob
    // this transaction is about to reference cannot be swept before it commits.
    db::execute(
        "SELECT pg_catalog.pg_advisory_xact_lock_shared($1)",
        &[gc_lock_key(scope).into()],
    )?;
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
pub fn get(scope: &Scope, sha256: &str, mismatch_code: &'static str) -> Result<Vec<u8>> {
    let content = db::select_one(
        "SELECT content FROM ledger.blobs \
          WHERE tenant_id = $1 AND workspace_id = $2 AND sha256 = $3",
        &scope.args([sha256.into()]),
        |r| db::req::<Vec<u8>>(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found("BLOB_NOT_FOUND", "blob", sha256))?;
    let actual = hash::sha256_hex(&content);
    if actual != sha256 {
        return Err(LedgerError::new(
            Class::Corrupted,
            mismatch_code,
            "stored bytes do not match their sha256",
        )
        .with("expected", sha256)
        .with("actual", actual));
    }
    Ok(content)
}

/// The advisory lock key that orders blob writers against the purge's sweep, per scope.
pub fn gc_lock_key(scope: &Scope) -> i64 {
    let digest =
        hash::sha256_hex(format!("ledger.blobs\0{}\0{}", scope.tenant, scope.workspace).as_bytes());
    i64::from_str_radix(&digest[..15], 16).unwrap_or(0)
}
