//! A delaying proxy for LEDGER_BENCH_RTT_MS: the lifecycle clients reach the server through it,
//! so that every round trip costs what it would across a network (this kernel has no netem).
//! Each chunk of bytes is forwarded half the round-trip time after it was read, in order, in
//! both directions; chunks that arrive together leave together, as on a wire.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Starts the proxy in front of the server named by `conn` (a `host=<socket dir> port=<port>`
/// connection string, as bench.sh writes it) and returns the connection string that goes
/// through it.
pub fn start(conn: &str, rtt: Duration) -> String {
    let value = |key: &str| {
        conn.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .unwrap_or_else(|| panic!("LEDGER_BENCH_CONN has no {key}="))
            .to_owned()
    };
    let socket = format!("{}/.s.PGSQL.{}", value("host"), value("port"));
    let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listen");
    let port = listener.local_addr().expect("proxy address").port();
    thread::spawn(move || {
        for client in listener.incoming() {
            let client = client.expect("proxy accept");
            let server = UnixStream::connect(&socket).expect("proxy connect to the server");
            client.set_nodelay(true).expect("TCP_NODELAY");
            let (c2, s2) = (
                client.try_clone().expect("clone"),
                server.try_clone().expect("clone"),
            );
            pipe(client, server, rtt / 2);
            pipe(s2, c2, rtt / 2);
        }
    });
    let rest: Vec<&str> = conn
        .split_whitespace()
        .filter(|kv| !kv.starts_with("host=") && !kv.starts_with("port="))
        .collect();
    format!("host=127.0.0.1 port={port} {}", rest.join(" "))
}

/// Forwards `from` to `to`, each chunk `delay` after it was read: one thread reads and stamps,
/// one waits and writes.
fn pipe(
    mut from: impl Read + Send + 'static,
    mut to: impl Write + Send + 'static,
    delay: Duration,
) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0
                || tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    });
    thread::spawn(move || {
        for (due, bytes) in rx {
            let now = Instant::now();
            if due > now {
                thread::sleep(due - now);
            }
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
    });
}
