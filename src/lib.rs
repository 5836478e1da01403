//! `ledger`: an AI agent runtime's run ledger inside PostgreSQL.
//!
//! Pure logic lives in `model` (no Postgres calls, plain `#[test]`s); the other modules are thin
//! SPI layers exposing it as SQL functions in schema `ledger`.

use pgrx::prelude::*;

mod blobs;
mod db;
mod error;
mod feed;
mod guc;
mod jsonb;
mod model;
mod runs;
mod scope;
mod steps;

::pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "ledger_schema", bootstrap);
extension_sql_file!("../sql/finalize.sql", name = "ledger_finalize", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    guc::init();
}

/// The allowed status transitions of runs, steps and tasks (SOIT §2.3, §2.4), as held in Rust.
#[pg_extern(immutable, parallel_safe)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn status_transitions() -> TableIterator<
    'static,
    (
        name!(resource, String),
        name!(from_status, String),
        name!(to_status, String),
    ),
> {
    use model::status::Resource;
    TableIterator::new(Resource::ALL.into_iter().flat_map(|r| {
        r.transitions().map(move |(from, to)| {
            (
                r.as_str().to_owned(),
                from.as_str().to_owned(),
                to.as_str().to_owned(),
            )
        })
    }))
}

#[cfg(any(test, feature = "pg_test"))]
mod testing;

/// Required by `#[pg_test]`: called once before the test cluster starts.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
