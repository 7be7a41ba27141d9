//! Talking to a vm's agent through its hybrid vsock socket. Placeholder
//! until the protocol crate's client lands.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use protocol::{read_frame, send, Frame, Hello, Message, AGENT_PORT, PROTOCOL_VERSION};

fn connect(uds: &Path, timeout: Duration) -> anyhow::Result<UnixStream> {
    let mut s = UnixStream::connect(uds)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(format!("CONNECT {AGENT_PORT}\n").as_bytes())?;
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line)?;
    anyhow::ensure!(line.starts_with("OK "), "vsock handshake failed: {line:?}");
    send(
        &mut s,
        Message::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            software: env!("CARGO_PKG_VERSION").into(),
        }),
    )?;
    match read_frame(&mut s)? {
        Frame::Message(Message::Hello(_)) => Ok(s),
        other => anyhow::bail!("unexpected reply to hello: {other:?}"),
    }
}

pub fn ping(uds: &Path, timeout: Duration) -> anyhow::Result<()> {
    let mut s = connect(uds, timeout)?;
    send(&mut s, Message::Ping)?;
    match read_frame(&mut s)? {
        Frame::Message(Message::Pong { .. }) => Ok(()),
        other => anyhow::bail!("unexpected reply to ping: {other:?}"),
    }
}

pub fn shutdown(uds: &Path, timeout: Duration) -> anyhow::Result<()> {
    let mut s = connect(uds, timeout)?;
    send(&mut s, Message::Shutdown)?;
    match read_frame(&mut s)? {
        Frame::Message(Message::ShuttingDown) => Ok(()),
        other => anyhow::bail!("unexpected reply to shutdown: {other:?}"),
    }
}
