//! The ledger's error type as the extension raises it. The type itself (`LedgerError`, its
//! `Class` and `Result`) is the pure core's (`ledger_model::error`); this is the one place that
//! turns it into a PostgreSQL error: SQLSTATE by class, `ledger: ` message, JSON DETAIL.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{pg_sys, PgLogLevel, PgSqlErrorCode};
use std::ffi::CString;

pub use ledger_model::error::{Code, LedgerError, Result};

/// Raises `e` as a PostgreSQL ERROR. Like `ereport(ERROR)` it does not return: the Rust frames
/// unwind and PostgreSQL aborts the statement.
pub fn raise(e: LedgerError) -> ! {
    let code = PgSqlErrorCode::from(packed(e.class().sqlstate()));
    ErrorReport::new(code, e.wire_message(), "ledger")
        .set_detail(e.wire_detail())
        .report(PgLogLevel::ERROR);
    unreachable!("an ERROR does not return")
}

/// Hands `e` to PostgreSQL as the refusal of a GUC check hook, which must not raise it itself:
/// PostgreSQL reports it with the SQLSTATE, message and DETAIL given here.
pub fn report_check_failure(e: &LedgerError) {
    // Neither text can hold a NUL (they name the argument, not the refused value).
    let message = CString::new(e.wire_message()).unwrap_or_default();
    let detail = CString::new(e.wire_detail()).unwrap_or_default();
    // SAFETY: these globals are how a check hook reports; PostgreSQL expects palloc'd strings
    // and resets them before each hook call.
    unsafe {
        pg_sys::GUC_check_errcode(packed(e.class().sqlstate()));
        pg_sys::GUC_check_errmsg_string = pg_sys::pstrdup(message.as_ptr());
        pg_sys::GUC_check_errdetail_string = pg_sys::pstrdup(detail.as_ptr());
    }
}

/// PostgreSQL's packed form of a five-character SQLSTATE (its `MAKE_SQLSTATE`), so that the
/// class table in the pure core is the only one.
fn packed(sqlstate: &str) -> i32 {
    sqlstate
        .bytes()
        .enumerate()
        .map(|(i, b)| ((i32::from(b) - i32::from(b'0')) & 0x3F) << (6 * i))
        .sum()
}

/// The error type of every SQL function (`#[pg_extern]`). It has no values: `?` converts a
/// `LedgerError` into it by raising that error on the spot, which is what returning it would
/// have led to. (pgrx gives a returned error its own SQLSTATE only when it is exactly an
/// `ErrorReport`, and `From<LedgerError> for ErrorReport` cannot be written here: both types are
/// other crates'.)
pub enum SqlError {}

impl From<LedgerError> for SqlError {
    fn from(e: LedgerError) -> SqlError {
        raise(e)
    }
}

/// pgrx requires it of a function's error type; there is never one to show.
impl std::fmt::Display for SqlError {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {}
    }
}

/// A failed SPI call: a defect of the ledger (its own statements), reported as `INTERNAL`.
pub fn spi_failed(e: pgrx::spi::Error) -> LedgerError {
    LedgerError::internal(format!("SPI failed: {e}"))
}
