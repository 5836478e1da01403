//! Every SQL example in the documentation runs: the ```sql blocks of docs/reference.md in order
//! in a fresh database, and those of README.md after the demo walkthrough (they continue it), each
//! through psql with ON_ERROR_STOP, as a reader would paste them. Run like tests/sessions.rs
//! (`-- --ignored`).

mod common;

use common::*;
use std::io::Write;
use std::process::Stdio;

/// The text of every ```sql block of a document, in order.
fn sql_blocks(doc: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in doc.lines() {
        match (inside, line.trim_end()) {
            (false, "```sql") => inside = true,
            (true, "```") => inside = false,
            (true, l) => {
                out.push_str(l);
                out.push('\n');
            }
            _ => {}
        }
    }
    out
}

/// Runs `script` through psql in `db`; with `stop_on_error`, panics with psql's output on an error.
fn psql(db: &str, script: &str, stop_on_error: bool) {
    let mut child = pg_client("psql")
        .args([
            "-d",
            db,
            "-X",
            "-v",
            if stop_on_error {
                "ON_ERROR_STOP=1"
            } else {
                "ON_ERROR_STOP=0"
            },
            "-f",
            "-",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psql starts");
    child
        .stdin
        .take()
        .expect("psql's stdin")
        .write_all(script.as_bytes())
        .expect("the script reaches psql");
    let out = child.wait_with_output().expect("psql ends");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stop_on_error || (out.status.success() && !text.contains("ERROR:")),
        "an example failed:\n{text}"
    );
}

#[test]
#[ignore]
fn every_example_of_the_reference_runs() {
    let examples = sql_blocks(include_str!("../docs/reference.md"));
    assert!(
        examples.lines().count() > 100,
        "the reference lost its examples"
    );
    let db = database("ledger_docs_reference");
    psql(&db, &examples, true);
}

#[test]
#[ignore]
fn every_example_of_the_readme_runs_after_the_walkthrough() {
    let examples = sql_blocks(include_str!("../README.md"));
    assert!(
        examples.contains("claim_tool_call"),
        "the README lost its examples"
    );
    let db = database("ledger_docs_readme");
    // The walkthrough shows refused calls on purpose; the README's examples continue from the
    // state it leaves (the demo's run, its tool calls), in a session of their own.
    psql(&db, include_str!("pg_regress/sql/walkthrough.sql"), false);
    psql(&db, &examples, true);
}

/// Runs a Python script of tests/ that takes the README and a connection string.
fn readme_python(script: &str, db: &str) {
    let db = database(db);
    let dsn = format!(
        "host={} port={} dbname={db} user=postgres",
        env("LEDGER_TEST_HOST"),
        env("LEDGER_TEST_PORT")
    );
    let out = std::process::Command::new("python3")
        .args([script, "README.md", &dsn])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The README's Python follower, run as written (tests/readme_follower.py) with psycopg 3.
#[test]
#[ignore]
fn the_readme_python_follower_gets_every_event_once() {
    readme_python("tests/readme_follower.py", "ledger_docs_python");
}

/// The README's Python worker, run as written (tests/readme_worker.py): a worker process killed
/// mid-call, a takeover, a person's two decisions, and each side effect exactly once.
#[test]
#[ignore]
fn the_readme_python_worker_survives_a_killed_worker() {
    readme_python("tests/readme_worker.py", "ledger_docs_worker");
}
