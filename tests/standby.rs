//! A hot standby (a real streaming replica made with pg_basebackup): the read functions answer
//! there exactly as on the primary, so investigations can run on a replica; writers fail
//! cleanly (25006) and leave the session usable.

mod common;

use common::*;
use postgres::{Client, NoTls};
use std::io::Write;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// A streaming replica of the cluster under test, stopped and removed on drop.
struct Standby {
    dir: String,
    port: u16,
}

impl Standby {
    fn start() -> Standby {
        let port: u16 = env("LEDGER_TEST_PORT").parse::<u16>().expect("a port") + 100;
        let dir = format!("/tmp/ledger-standby-{port}");
        let _ = std::fs::remove_dir_all(&dir);
        let made = pg_client("pg_basebackup")
            // The test cluster holds every earlier test's database (about 900 MB by now): no
            // fsync of the copy and no manifest, which a throwaway replica does not need.
            .args([
                "-D",
                &dir,
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
                "--no-manifest",
            ])
            .status()
            .expect("pg_basebackup runs");
        assert!(made.success(), "pg_basebackup failed");
        // What `-R` would write, minus the options newer libpq versions add: the PyPI builds'
        // walreceiver loads the system's older libpq, which refuses them.
        std::fs::write(format!("{dir}/standby.signal"), "").expect("standby.signal");
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(format!("{dir}/postgresql.auto.conf"))
            .expect("postgresql.auto.conf");
        writeln!(
            conf,
            "primary_conninfo = 'host={} port={} user=postgres'",
            env("LEDGER_TEST_HOST"),
            env("LEDGER_TEST_PORT")
        )
        .expect("primary_conninfo");
        let standby = Standby { dir, port };
        // The primary's options too: a standby needs max_prepared_transactions at least as high.
        // fsync off spares its start the sync of the whole copied data directory.
        let options = format!(
            "-p {port} -k {} -c listen_addresses='' -c fsync=off {}",
            standby.dir,
            std::env::var("LEDGER_TEST_SERVER_OPTIONS").unwrap_or_default()
        );
        let log = format!("{}/server.log", standby.dir);
        let started = pg_tool("pg_ctl")
            .args([
                "-D",
                &standby.dir,
                "-l",
                &log,
                "-w",
                "-o",
                &options,
                "start",
            ])
            .stdout(Stdio::null())
            .status()
            .expect("pg_ctl runs");
        assert!(started.success(), "the standby did not start; see {log}");
        standby
    }

    fn connect(&self, db: &str) -> Client {
        let conn = format!(
            "host={} port={} user=postgres dbname={db}",
            self.dir, self.port
        );
        Client::connect(&conn, NoTls).unwrap_or_else(|e| panic!("connect {conn}: {e}"))
    }

    /// Waits until the standby has replayed everything the primary has written so far.
    fn catch_up(&self, primary: &mut Client, standby: &mut Client) {
        let target: String = one(primary, "SELECT pg_current_wal_lsn()::text");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !one::<bool>(
            standby,
            &format!("SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn"),
        ) {
            assert!(Instant::now() < deadline, "the standby did not catch up");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        let _ = pg_tool("pg_ctl")
            .args(["-D", &self.dir, "-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What the read functions say about run `r` and its artifact, in one text.
const READS: &str = "SELECT concat_ws(' | ', \
       (SELECT string_agg(event_id || ':' || seq || ':' || event_type, ',' ORDER BY seq) FROM ledger.events_since('r')), \
       (SELECT string_agg(event_id, ',' ORDER BY seq) FROM ledger.events_since('r', (SELECT event_id FROM ledger.events_since('r') WHERE seq = 2))), \
       ledger.run_channel('r'), ledger.run_inputs('r')::text, \
       encode(ledger.get_artifact((SELECT id FROM ledger.run_artifacts WHERE run_id = 'r' AND artifact_type = 'file')), 'escape'), \
       ledger.replay_bundle('r')::text, ledger.run_evidence('r')::text, ledger.replay_ready('r')::text, \
       (SELECT string_agg(s->>'spanId' || ' ' || (s->>'name'), ',') \
          FROM jsonb_array_elements(ledger.otel_trace('r')->'resourceSpans'->0->'scopeSpans'->0->'spans') s), \
       (SELECT string_agg(x::text, ',') FROM ledger.run_overview x), \
       (SELECT count(*) FROM ledger.tool_calls_in_doubt))";

#[test]
#[ignore]
fn the_read_functions_answer_on_a_hot_standby_as_on_the_primary() {
    let db = database("ledger_standby");
    let mut primary = session(&db);
    exec(
        &mut primary,
        "SELECT ledger.create_run('chat', '{\"q\": \"hello\"}', run_id => 'r'); \
         SELECT ledger.transition_run('r', 'running'); \
         SELECT ledger.create_step('r', 'llm', step_id => 's1'); \
         SELECT ledger.transition_step('s1', 'running'); \
         SELECT ledger.put_artifact('r', convert_to('evidence', 'UTF8'), 'file'); \
         SELECT ledger.record_cost('r', 'tokens', 10, 0.01, 'USD')",
    );
    let standby = Standby::start();
    // Written after the base backup: reaches the standby through streaming only.
    exec(
        &mut primary,
        "SELECT ledger.transition_step('s1', 'succeeded'); \
         SELECT ledger.claim_tool_call('r', 'fetch', '{\"page\": 1}', idempotency_key => 'f1')",
    );
    let mut replica = standby.connect(&db);
    standby.catch_up(&mut primary, &mut replica);
    assert!(one::<bool>(&mut replica, "SELECT pg_is_in_recovery()"));
    exec(&mut replica, "SELECT ledger.set_scope('acme', 'support')");

    let on_primary: String = one(&mut primary, READS);
    let on_standby: String = one(&mut replica, READS);
    assert!(on_primary.contains("tool_call.claimed"), "{on_primary}");
    assert_eq!(on_standby, on_primary);

    // Another scope sees nothing there either.
    exec(&mut replica, "SELECT ledger.set_scope('other', 'w')");
    let e = replica
        .query_one("SELECT ledger.replay_bundle('r')", &[])
        .unwrap_err();
    assert_eq!(failure(&e), ("P0002".into(), "RUN_NOT_FOUND".into()));

    // Writers fail as read-only, and the session goes on.
    exec(&mut replica, "SELECT ledger.set_scope('acme', 'support')");
    for write in [
        "SELECT ledger.claim_tool_call('r', 'fetch', '{\"page\": 2}', idempotency_key => 'f2')",
        "SELECT ledger.transition_run('r', 'succeeded')",
        "SELECT ledger.record_cost('r', 'tokens', 1, 0.01, 'USD')",
    ] {
        let e = replica.query_one(write, &[]).unwrap_err();
        assert_eq!(failure(&e), ("25006".into(), "READ_ONLY".into()), "{write}");
    }
    assert_eq!(one::<String>(&mut replica, READS), on_primary);
}
