//! tine-agent: runs inside the guest, reachable over virtio-vsock.
//!
//! Built as a static glibc binary (`-C target-feature=+crt-static`, see
//! scripts/build-agent) so it runs from any initramfs.
//!
//! - `tine-agent serve [--vsock PORT] [--unix PATH] [--tcp ADDR]
//!   [--exit-on-shutdown] [--root DIR]`: serves the protocol
//!   (crates/protocol) on each listener given; with none, on vsock port
//!   `protocol::AGENT_PORT`. `--exit-on-shutdown` makes `Shutdown` exit the
//!   agent instead of powering the machine off, and `--root DIR` makes
//!   Wake and Quiesce a sandbox (file paths under DIR, no system-wide
//!   change): both for running it on a host, in tests.
//! - `tine-agent vsock-echo PORT`: every connection on PORT gets its bytes
//!   back (the VMM's vsock round-trip test).

mod conns;
mod crng;
mod fs;
mod jobs;
mod proxy;
mod quiesce;
mod serve;
mod vsock;
mod wake;

use std::io::{Read, Write};
use std::process::ExitCode;

use std::path::PathBuf;
use std::sync::Arc;

use serve::{OnShutdown, Settings};

const USAGE: &str =
    "usage: tine-agent serve [--vsock PORT] [--unix PATH] [--tcp ADDR] [--exit-on-shutdown] [--root DIR]
       tine-agent vsock-echo PORT";

enum Listen {
    Vsock(u32),
    Unix(String),
    Tcp(String),
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("serve") => {
            let mut listens = Vec::new();
            let mut on_shutdown = OnShutdown::PowerOff;
            let mut root = None;
            let mut it = args[2..].iter();
            while let Some(a) = it.next() {
                if a == "--exit-on-shutdown" {
                    on_shutdown = OnShutdown::Exit;
                    continue;
                }
                let l = match (a.as_str(), it.next()) {
                    ("--vsock", Some(p)) => match p.parse() {
                        Ok(p) => Listen::Vsock(p),
                        Err(_) => {
                            eprintln!("tine-agent: bad vsock port {p:?}\n{USAGE}");
                            return ExitCode::from(2);
                        }
                    },
                    ("--unix", Some(p)) => Listen::Unix(p.clone()),
                    ("--tcp", Some(a)) => Listen::Tcp(a.clone()),
                    ("--root", Some(d)) => {
                        root = Some(PathBuf::from(d));
                        continue;
                    }
                    _ => {
                        eprintln!("{USAGE}");
                        return ExitCode::from(2);
                    }
                };
                listens.push(l);
            }
            if listens.is_empty() {
                listens.push(Listen::Vsock(protocol::AGENT_PORT));
            }
            // In a guest (vsock, no sandbox root): the effects proxy.
            if root.is_none() && listens.iter().any(|l| matches!(l, Listen::Vsock(_))) {
                proxy::start();
            }
            serve_all(listens, Arc::new(Settings { on_shutdown, root }))
        }
        Some("vsock-echo") => {
            let Some(port) = args.get(2).and_then(|p| p.parse::<u32>().ok()) else {
                eprintln!("usage: tine-agent vsock-echo PORT");
                return ExitCode::from(2);
            };
            match echo(port) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("tine-agent: vsock-echo on port {port}: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// Binds every listener, then serves them all; returns only on failure.
fn serve_all(listens: Vec<Listen>, settings: Arc<Settings>) -> ExitCode {
    let mut threads = Vec::new();
    for l in listens {
        let settings = settings.clone();
        let t = match l {
            Listen::Vsock(port) => match bind_vsock(port) {
                Ok(lst) => {
                    eprintln!("tine-agent: listening on vsock port {port}");
                    std::thread::spawn(move || {
                        accept_loop(|| lst.accept(), settings, format!("vsock port {port}"))
                    })
                }
                Err(e) => return bind_failed(&format!("vsock port {port}"), &e),
            },
            Listen::Unix(path) => match bind_unix(&path) {
                Ok(lst) => {
                    eprintln!("tine-agent: listening on {path}");
                    std::thread::spawn(move || {
                        accept_loop(|| lst.accept().map(|(s, _)| s), settings, path)
                    })
                }
                Err(e) => return bind_failed(&path, &e),
            },
            Listen::Tcp(addr) => match std::net::TcpListener::bind(&addr) {
                Ok(lst) => {
                    eprintln!("tine-agent: listening on tcp {addr}");
                    std::thread::spawn(move || {
                        accept_loop(|| lst.accept().map(|(s, _)| s), settings, addr)
                    })
                }
                Err(e) => return bind_failed(&addr, &e),
            },
        };
        threads.push(t);
    }
    for t in threads {
        let _ = t.join();
    }
    ExitCode::FAILURE
}

/// Binds the vsock port, retrying for a few seconds in case the transport
/// is still coming up.
fn bind_vsock(port: u32) -> std::io::Result<vsock::VsockListener> {
    let mut tries = 0;
    loop {
        match vsock::VsockListener::bind(port) {
            Ok(l) => return Ok(l),
            Err(e) if tries >= 50 => return Err(e),
            Err(_) => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// Binds a Unix socket, replacing a stale socket file left at `path`.
fn bind_unix(path: &str) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_socket() && std::os::unix::net::UnixStream::connect(path).is_err() {
            std::fs::remove_file(path)?;
        }
    }
    std::os::unix::net::UnixListener::bind(path)
}

fn bind_failed(what: &str, e: &std::io::Error) -> ExitCode {
    eprintln!("tine-agent: cannot listen on {what}: {e}");
    ExitCode::FAILURE
}

/// Accepts connections forever, one thread each.
fn accept_loop<C: protocol::Connection>(
    mut accept: impl FnMut() -> std::io::Result<C>,
    settings: Arc<Settings>,
    what: String,
) {
    loop {
        match accept() {
            Ok(conn) => {
                let settings = settings.clone();
                let spawned = std::thread::Builder::new()
                    .name("tine-agent-conn".into())
                    .spawn(move || serve::handle(conn, &settings));
                if let Err(e) = spawned {
                    eprintln!("tine-agent: cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                // EMFILE and friends: back off rather than spin.
                eprintln!("tine-agent: accept on {what}: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

fn echo(port: u32) -> std::io::Result<()> {
    let listener = vsock::VsockListener::bind(port)?;
    println!("tine-agent: echo listening on vsock port {port}");
    loop {
        let mut stream = listener.accept()?;
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if stream.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }
}
