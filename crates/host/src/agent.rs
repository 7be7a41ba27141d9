//! A vm's agent, reached through the VMM's hybrid vsock socket.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use protocol::client::{self, ClientError};

/// Connects to the agent and exchanges Hello. A handshake the guest left
/// unanswered is tried once more: the VMM resets the abandoned request
/// (and logs where it stood), so a guest that was only slow, on a loaded
/// host, answers the second; one that answers neither is reported.
///
/// The last line of defence, tried once more: a connection the guest did
/// not answer, or closed or reset before any request was sent on it (the
/// handshake or Hello). Nothing was asked of the agent yet, so nothing
/// can happen twice. Seen in the nested host under heavy load, right after
/// a fork child's wake-up (docs/design/fork.md); each retry is logged.
pub fn connect(uds: &Path, timeout: Duration) -> Result<UnixStream, ClientError> {
    match connect_once(uds, timeout) {
        Err(ClientError::HandshakeTimeout { port }) => {
            tracing::warn!(
                "the guest did not answer a connection to vsock port {port} within {:.0} s; trying once more",
                timeout.as_secs_f64()
            );
            connect_once(uds, timeout)
        }
        Err(e) if closed_before_request(&e) => {
            tracing::warn!(
                "the guest closed a new connection to vsock port {} before any request ({e}); trying once more",
                protocol::AGENT_PORT
            );
            std::thread::sleep(Duration::from_millis(100));
            connect_once(uds, timeout)
        }
        r => r,
    }
}

/// Whether a failed [`connect_once`] ended because the peer closed or
/// reset the connection (not a refusal it explained, a version mismatch
/// or a local error).
fn closed_before_request(e: &ClientError) -> bool {
    use protocol::ProtocolError;
    match e {
        ClientError::Handshake { reason, .. } => reason.contains("connection closed"),
        ClientError::Protocol(ProtocolError::Closed) => true,
        ClientError::Protocol(ProtocolError::Io(io)) => matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof
        ),
        _ => false,
    }
}

fn connect_once(uds: &Path, timeout: Duration) -> Result<UnixStream, ClientError> {
    let mut s = client::connect_vsock_uds(uds, protocol::AGENT_PORT, timeout)?;
    s.set_read_timeout(Some(timeout))
        .map_err(ClientError::Local)?;
    client::hello(&mut s)?;
    s.set_read_timeout(None).map_err(ClientError::Local)?;
    Ok(s)
}

/// Whether the agent answers a ping within `timeout`, tried once: for
/// callers that poll.
pub fn probe(uds: &Path, timeout: Duration) -> Result<client::Pong, ClientError> {
    let mut s = connect_once(uds, timeout)?;
    s.set_read_timeout(Some(timeout))
        .map_err(ClientError::Local)?;
    client::ping(&mut s)
}

/// Asks the agent to power the guest off.
pub fn shutdown(uds: &Path, timeout: Duration) -> Result<(), ClientError> {
    let s = connect(uds, timeout)?;
    s.set_read_timeout(Some(timeout))
        .map_err(ClientError::Local)?;
    client::shutdown(s)
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixListener;

    use protocol::{Hello, Message, PROTOCOL_VERSION};

    use super::*;

    /// How the fake guest treats the first connection.
    #[derive(Clone, Copy, PartialEq)]
    enum First {
        /// Unanswered, as a stuck or busy guest leaves it.
        Silent,
        /// Taken (`OK`), then closed before the Hello is answered, as a
        /// guest whose vsock reset it.
        Closed,
    }

    /// A VMM socket that treats its first `CONNECT` as `first` says and
    /// answers the second with `OK` and a Hello.
    fn fake_vmm(path: &Path, first: First) -> std::thread::JoinHandle<usize> {
        let listener = UnixListener::bind(path).expect("bind");
        std::thread::spawn(move || {
            let mut tries = 0;
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                tries += 1;
                let mut r = BufReader::new(conn.try_clone().expect("clone"));
                let mut line = String::new();
                r.read_line(&mut line).expect("connect line");
                assert_eq!(line, format!("CONNECT {}\n", protocol::AGENT_PORT));
                if tries == 1 && first == First::Silent {
                    // Hold the connection until the client gives up.
                    let _ = r.read_line(&mut line);
                    continue;
                }
                let mut w = conn;
                w.write_all(b"OK 1073741824\n").expect("ok");
                if tries == 1 && first == First::Closed {
                    let _ = protocol::read_frame(&mut r);
                    continue; // dropped: closed with the Hello unanswered
                }
                let _ = protocol::read_frame(&mut r);
                protocol::send(
                    &mut w,
                    Message::Hello(Hello {
                        protocol: PROTOCOL_VERSION,
                        software: "fake agent".into(),
                    }),
                )
                .expect("hello");
                break;
            }
            tries
        })
    }

    #[test]
    fn test_an_unanswered_handshake_is_tried_once_more() {
        let dir = std::env::temp_dir().join(format!("tine-agent-client-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("v.sock");
        let vmm = fake_vmm(&path, First::Silent);
        connect(&path, Duration::from_millis(300)).expect("the second try connects");
        assert_eq!(vmm.join().expect("fake vmm"), 2);

        // Closed before any request: nothing was asked, so tried again.
        let _ = std::fs::remove_file(&path);
        let vmm = fake_vmm(&path, First::Closed);
        connect(&path, Duration::from_millis(300)).expect("the second try connects");
        assert_eq!(vmm.join().expect("fake vmm"), 2);

        // A guest that answers neither is reported, after two tries.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).expect("bind");
        let t = std::time::Instant::now();
        let e = connect(&path, Duration::from_millis(300)).expect_err("no answer");
        assert!(matches!(e, ClientError::HandshakeTimeout { .. }), "{e:?}");
        assert!(
            t.elapsed() >= Duration::from_millis(600),
            "{:?}",
            t.elapsed()
        );
        drop(listener);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
