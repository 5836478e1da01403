//! Cancellation points in long pure work. A cancel, `statement_timeout` or
//! `pg_terminate_backend` is only acted on when the backend checks for interrupts, and pure Rust
//! work over a large value (parsing, redaction, canonical JSON, hashing) would otherwise run to
//! its end first: seconds on a 10 MB document. The model makes no Postgres calls, so the
//! extension installs PostgreSQL's check here when it is loaded; plain `#[test]`s run without.

use std::io;
use std::sync::OnceLock;

static CHECK: OnceLock<fn()> = OnceLock::new();

/// How many bytes of text pass between two checks: a few tens of microseconds of work.
pub const EVERY_BYTES: usize = 64 * 1024;

/// Sets the check once per process (a backend loads the extension once).
pub fn install(check: fn()) {
    let _ = CHECK.set(check);
}

/// Raises the pending interrupt, if any, by unwinding out of the current work.
#[inline]
pub fn check() {
    if let Some(f) = CHECK.get() {
        f();
    }
}

/// A writer that checks for interrupts every `EVERY_BYTES` bytes passed through it.
pub struct Checked<W> {
    inner: W,
    since: usize,
}

impl<W> Checked<W> {
    pub fn new(inner: W) -> Self {
        Checked { inner, since: 0 }
    }

    pub fn into_inner(self) -> W {
        self.inner
    }
}

impl<W: io::Write> io::Write for Checked<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.since += buf.len();
        if self.since >= EVERY_BYTES {
            self.since = 0;
            check();
        }
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
