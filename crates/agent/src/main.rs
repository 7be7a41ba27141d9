//! tine-agent: runs inside the guest, reachable over virtio-vsock.
//!
//! Built as a static glibc binary (`-C target-feature=+crt-static`, see
//! scripts/build-agent) so it runs from any initramfs.
//!
//! For now it offers `vsock-echo PORT`: every connection on PORT gets its
//! bytes back (the VMM's vsock round-trip test). The request protocol of the
//! agent arrives with the CLI issue.

mod vsock;

use std::io::{Read, Write};
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
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
            eprintln!("usage: tine-agent vsock-echo PORT");
            ExitCode::from(2)
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
