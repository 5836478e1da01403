//! The ledger's pure logic: no Postgres calls, tested with plain `#[test]`s (`cargo test -p
//! ledger-model`). A crate of its own without pgrx, so nothing here can reach the database; the
//! extension (the workspace root, `src/`) exposes it through SQL functions, and the benchmark
//! client (`bench/`) runs the same code in process.
pub mod args;
pub mod budgets;
pub mod error;
pub mod events;
pub mod evidence;
pub mod feed;
pub mod graph_checkpoints;
pub mod hash;
pub mod ids;
pub mod interrupt;
pub mod json;
pub mod notifier;
pub mod outbox;
pub mod redaction;
pub mod retention;
pub mod run_leases;
pub mod schedules;
pub mod status;
pub mod text;
pub mod tool_calls;
pub mod transition;
