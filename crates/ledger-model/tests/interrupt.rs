//! The cancellation points of `ledger_model::interrupt` in the long pure work over large values:
//! parsing, canonical JSON, hashing, redaction. A test of its own (an integration test) because
//! it drives `json` and `redaction`, which `interrupt` itself does not know.

use ledger_model::interrupt::{install, EVERY_BYTES};
use ledger_model::{json, redaction};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};

static CHECKS: AtomicUsize = AtomicUsize::new(0);

fn count() {
    CHECKS.fetch_add(1, Ordering::SeqCst);
}

/// Checks made while `work` ran: at least its own (tests running alongside add theirs).
fn checks_during(work: impl FnOnce()) -> usize {
    install(count);
    let before = CHECKS.load(Ordering::SeqCst);
    work();
    CHECKS.load(Ordering::SeqCst) - before
}

#[test]
fn long_work_over_a_large_value_checks_as_it_goes() {
    // About 2 MB of canonical JSON in 20,000 objects.
    let big = Value::Array(
        (0..20_000)
            .map(|i| json!({"password": "x", "v": i, "pad": "p".repeat(80)}))
            .collect(),
    );
    let text = json::canonical(&big);
    let chunks = text.len() / EVERY_BYTES;
    assert!(chunks >= 30, "{} bytes", text.len());
    assert!(checks_during(|| drop(json::parse(&text))) >= chunks);
    assert!(checks_during(|| drop(json::canonical(&big))) >= chunks);
    assert!(checks_during(|| drop(json::request_hash(&big))) >= chunks);
    assert!(
        checks_during(|| {
            json::canonical_len(&big);
        }) >= chunks
    );
    assert!(checks_during(|| drop(redaction::redact(&Default::default(), big.clone()))) >= 20_000);
    // A key or a text of megabytes is scanned with checks too.
    assert!(checks_during(|| assert!(!redaction::is_credential(&text))) >= chunks);
    assert!(
        checks_during(|| assert!(!redaction::is_sensitive_key(&Default::default(), &text)))
            >= chunks
    );
}
