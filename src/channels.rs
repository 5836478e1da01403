//! The names of the run channels, keyed with the database's secret (`ledger.channel_key`, which
//! only `ledger_owner` reads): any role may LISTEN on any channel, so a name must not be
//! computable from a run's public names. The key is read once per backend and kept until its
//! table is invalidated, so the write path pays no query per notification.

use crate::db;
use crate::error::{LedgerError, Result};
use crate::scope::Scope;
use ledger_model::hash::ChannelKey;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;

thread_local! {
    /// The key, with the oid of the table it was read from.
    static KEY: RefCell<Option<(pg_sys::Oid, ChannelKey)>> = const { RefCell::new(None) };
}

/// Called by `_PG_init`.
pub fn init() {
    // SAFETY: a plain C callback, registered once per process (children of a preloading
    // postmaster inherit it).
    unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(forget), pg_sys::Datum::from(0)) };
}

/// A relcache invalidation of the key's table (its DROP with DROP EXTENSION, in this backend or
/// another, or any change to it) or of every relation forgets the key: a backend never keeps a
/// dropped extension's key across DROP and CREATE EXTENSION.
#[pg_guard]
unsafe extern "C-unwind" fn forget(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    KEY.with(|k| {
        // Never borrowed across a call into PostgreSQL (which is where invalidations arrive).
        if let Ok(mut k) = k.try_borrow_mut() {
            if relid == pg_sys::InvalidOid || k.as_ref().is_some_and(|(table, _)| *table == relid) {
                *k = None;
            }
        }
    });
}

/// The run's channel name in the scope.
pub fn run_channel(scope: &Scope, run_id: &str) -> Result<String> {
    with_key(|key| key.run_channel(&scope.tenant, &scope.workspace, run_id))
}

/// The 16 bytes of the run's channel name (what writers hand the notifier worker).
pub fn run_digest(scope: &Scope, run_id: &str) -> Result<[u8; 16]> {
    with_key(|key| key.digest(&scope.tenant, &scope.workspace, run_id))
}

fn with_key<R>(f: impl Fn(&ChannelKey) -> R) -> Result<R> {
    if let Some(r) = KEY.with(|k| k.borrow().as_ref().map(|(_, key)| f(key))) {
        return Ok(r);
    }
    let (table, key) = load()?;
    let r = f(&key);
    KEY.with(|k| *k.borrow_mut() = Some((table, key)));
    Ok(r)
}

/// Reads the key in force (the oldest row: a restore adds the dumped one beside the one its
/// CREATE EXTENSION made). Only the ledger's functions, running as `ledger_owner`, can.
fn load() -> Result<(pg_sys::Oid, ChannelKey)> {
    let missing = || {
        LedgerError::internal(
            "no run channel key (ledger.channel_key): finish ALTER EXTENSION ledger UPDATE",
        )
    };
    let table = db::select_one(
        "SELECT pg_catalog.to_regclass('ledger.channel_key')::oid",
        &[],
        |r| db::opt::<pg_sys::Oid>(r, 1),
    )?
    .flatten()
    .ok_or_else(missing)?;
    let secret = db::select_one(
        "SELECT key FROM ledger.channel_key ORDER BY created_at, key LIMIT 1",
        &[],
        |r| db::req::<Vec<u8>>(r, 1),
    )?
    .ok_or_else(missing)?;
    Ok((table, ChannelKey::new(&secret)?))
}
