//! docs/reference.md against the declarations it documents: the event types, the error codes and
//! the audit records the ledger writes. One reader of the reference for all of them.

use ledger_model::error::Code;
use ledger_model::events::{AuditKind, EVENT_TYPES};

const REFERENCE: &str = include_str!("../../../docs/reference.md");

/// The text of the reference's `## heading` section, up to the next `## `.
fn section(heading: &str) -> &'static str {
    REFERENCE
        .split(&format!("\n## {heading}\n"))
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .unwrap_or_else(|| panic!("docs/reference.md has a {heading} section"))
}

/// The rows of the first table in `text` that follows the line `after`, as cells without their
/// backquotes (the header and its `|---|` line left out).
fn table(text: &str, after: &str) -> Vec<Vec<String>> {
    let start = text
        .find(after)
        .unwrap_or_else(|| panic!("the reference has {after:?}"));
    text[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|cell| cell.trim().trim_matches('`').to_owned())
                .collect()
        })
        .collect()
}

/// The event reference has one heading per event type, and no other.
#[test]
fn the_event_reference_documents_every_event_type() {
    let mut documented: Vec<&str> = section("Event reference")
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        // Other headings of the section (the notifications) are not event types.
        .filter(|h| h.contains('.'))
        .collect();
    let mut declared: Vec<&str> = EVENT_TYPES.iter().map(|(t, _)| *t).collect();
    documented.sort_unstable();
    declared.sort_unstable();
    assert_eq!(documented, declared);
}

/// The Error codes table lists every declared code once, with its SQLSTATE and class, in the
/// declaration's order (grouped by class), and no other code.
#[test]
fn the_reference_lists_every_error_code() {
    let documented: Vec<Vec<String>> = table(section("Error codes"), "| code |")
        .into_iter()
        .map(|row| row[..3].to_vec())
        .collect();
    let declared: Vec<Vec<String>> = Code::ALL
        .iter()
        .map(|c| {
            vec![
                c.as_str().to_owned(),
                c.class().sqlstate().to_owned(),
                format!("{:?}", c.class()),
            ]
        })
        .collect();
    assert_eq!(documented, declared);
}

/// "Audit records the ledger writes" lists every `AuditKind` once, and no other.
#[test]
fn the_reference_lists_every_audit_kind() {
    let documented: Vec<String> = table(
        section("Evidence writers"),
        "#### Audit records the ledger writes",
    )
    .into_iter()
    .map(|row| row[0].clone())
    .collect();
    let declared: Vec<&str> = AuditKind::ALL.iter().map(|k| k.gateway_type()).collect();
    assert_eq!(documented, declared);
}
