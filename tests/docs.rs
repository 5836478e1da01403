//! Every SQL example in the documentation runs: the ```sql blocks of docs/reference.md in order
//! in a fresh database, and those of README.md, CONTRIBUTING.md and the other docs/*.md after the
//! demo walkthrough (they continue it), each document in a database of its own, through psql with
//! ON_ERROR_STOP, as a reader would paste them; the Python worker and follower of docs/workers.md
//! run as written (tests/docs/). Run like tests/sessions.rs (`-- --ignored`). The README's budget
//! (its length, its code blocks) is a plain test that needs no server.

mod common;

use common::*;
use std::io::Write;
use std::path::Path;
use std::process::Stdio;

/// The README's budget: a ten-minute read that links out. It grew to 1,379 lines once, one
/// appended manual at a time.
const README_MAX_LINES: usize = 400;
const README_MAX_BLOCK_LINES: usize = 25;

/// A document of the repository, read when the test runs.
fn doc(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

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
    let examples = sql_blocks(&doc("docs/reference.md"));
    assert!(
        examples.lines().count() > 100,
        "the reference lost its examples"
    );
    let db = database("ledger_docs_reference");
    psql(&db, &examples, true);
}

/// Runs `examples` in a fresh database `db` after the walkthrough, whose refused calls are on
/// purpose; the examples continue from the state it leaves (the demo's run, its tool calls), in
/// a session of their own.
fn after_the_walkthrough(db: &str, examples: &str) {
    let db = database(db);
    psql(&db, include_str!("pg_regress/sql/walkthrough.sql"), false);
    psql(&db, examples, true);
}

#[test]
#[ignore]
fn every_example_of_the_readme_runs_after_the_walkthrough() {
    let examples = sql_blocks(&doc("README.md"));
    assert!(
        examples.contains("claim_tool_call"),
        "the README lost its examples"
    );
    after_the_walkthrough("ledger_docs_readme", &examples);
}

/// CONTRIBUTING.md and every page of docs/ but the reference (which starts from nothing), each
/// after the walkthrough, so that a page added later is run too.
#[test]
#[ignore]
fn every_example_of_the_other_docs_runs_after_the_walkthrough() {
    let mut pages = vec!["CONTRIBUTING.md".to_owned()];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    for entry in std::fs::read_dir(&dir).expect("docs/ is readable") {
        let name = entry.expect("a docs/ entry").file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".md") && name != "reference.md" {
            pages.push(format!("docs/{name}"));
        }
    }
    pages.sort();
    let mut ran = Vec::new();
    for page in &pages {
        let examples = sql_blocks(&doc(page));
        if examples.trim().is_empty() {
            continue;
        }
        let stem = Path::new(page).file_stem().expect("a file name");
        after_the_walkthrough(
            &format!("ledger_docs_{}", stem.to_string_lossy().to_lowercase()),
            &examples,
        );
        ran.push(page.as_str());
    }
    assert!(
        ran.contains(&"docs/evidence.md"),
        "docs/evidence.md lost its examples (ran {ran:?})"
    );
}

/// Runs a Python script of tests/docs/ that takes a document and a connection string.
fn docs_python(script: &str, document: &str, db: &str) {
    let db = database(db);
    let dsn = format!(
        "host={} port={} dbname={db} user=postgres",
        env("LEDGER_TEST_HOST"),
        env("LEDGER_TEST_PORT")
    );
    let out = std::process::Command::new("python3")
        .args([script, document, &dsn])
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

/// The Python follower of docs/workers.md, run as written (tests/docs/workers_follower.py) with
/// psycopg 3.
#[test]
#[ignore]
fn the_plain_sql_python_follower_gets_every_event_once() {
    docs_python(
        "tests/docs/workers_follower.py",
        "docs/workers.md",
        "ledger_docs_python",
    );
}

/// The Python worker of docs/workers.md, run as written (tests/docs/workers_worker.py): a worker
/// process killed mid-call, a takeover, a person's two decisions, and each side effect exactly
/// once.
#[test]
#[ignore]
fn the_plain_sql_python_worker_survives_a_killed_worker() {
    docs_python(
        "tests/docs/workers_worker.py",
        "docs/workers.md",
        "ledger_docs_worker",
    );
}

/// The README stays a ten-minute read: at most `README_MAX_LINES` lines, and no code block over
/// `README_MAX_BLOCK_LINES`. Needs no server.
#[test]
fn the_readme_keeps_its_budget() {
    let readme = doc("README.md");
    let elsewhere = "move the text to its own manual and link it from the README's documentation \
                     map (clients/{python,typescript,console}/README.md, docs/install.md, \
                     docs/workers.md, docs/evidence.md, docs/reference.md, CONTRIBUTING.md)";
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, over its budget of {README_MAX_LINES}: {elsewhere}"
    );
    let mut opened: Option<usize> = None;
    for (n, line) in readme.lines().enumerate() {
        if !line.starts_with("```") {
            continue;
        }
        match opened.take() {
            None => opened = Some(n),
            Some(start) => {
                let size = n - start - 1;
                assert!(
                    size <= README_MAX_BLOCK_LINES,
                    "README.md's code block at line {} has {size} lines, over \
                     {README_MAX_BLOCK_LINES}: {elsewhere}, with the test that runs it",
                    start + 1
                );
            }
        }
    }
    assert!(opened.is_none(), "README.md has an unclosed code block");
}
