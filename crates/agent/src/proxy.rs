//! The guest end of the effects gateway (docs/design/effects.md): an HTTP
//! proxy endpoint on 127.0.0.1:3128 for the guest's programs, each
//! connection piped as bytes to a vsock stream to the host (CID 2, port
//! 3128), where the gateway listens for this vm. The agent does not parse
//! HTTP: the gateway does, and it knows which vm calls from the socket the
//! VMM delivers the connection to, never from these bytes.
//!
//! When the vsock stream breaks (a fork or restore resets the transport in
//! every copy), the loopback connection is reset too, so the program sees
//! an error and retries, and the retry reaches the gateway as the copy it
//! now is.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};

/// Where guest programs find the proxy.
pub const LISTEN: &str = "127.0.0.1:3128";
/// The vsock port of the gateway on the host.
pub const HOST_PORT: u32 = 3128;
const HOST_CID: u32 = 2;
const PROXY_URL: &str = "http://127.0.0.1:3128";
const NO_PROXY: &str = "localhost,127.0.0.1,::1";

/// Sets the proxy variables for what the agent starts, writes them for
/// login shells and PAM (`/etc/profile.d/tine-proxy.sh`,
/// `/etc/environment`), and serves the proxy endpoint. Called in a guest
/// only, before any other thread exists (it sets the agent's environment).
pub fn start() {
    let vars = [
        ("http_proxy", PROXY_URL),
        ("https_proxy", PROXY_URL),
        ("HTTP_PROXY", PROXY_URL),
        ("HTTPS_PROXY", PROXY_URL),
        ("no_proxy", NO_PROXY),
        ("NO_PROXY", NO_PROXY),
    ];
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    if let Err(e) = write_profile(&vars) {
        eprintln!("tine-agent: proxy: cannot write the proxy settings: {e}");
    }
    match TcpListener::bind(LISTEN) {
        Ok(l) => {
            eprintln!("tine-agent: http proxy on {LISTEN} (to the host's effects gateway)");
            let spawned = std::thread::Builder::new()
                .name("tine-agent-proxy".into())
                .spawn(move || accept_loop(l));
            if let Err(e) = spawned {
                eprintln!("tine-agent: proxy: cannot start: {e}");
            }
        }
        Err(e) => eprintln!("tine-agent: proxy: cannot listen on {LISTEN}: {e}"),
    }
}

fn write_profile(vars: &[(&str, &str)]) -> io::Result<()> {
    let mut sh = String::from(
        "# Written by tine-agent: programs reach the web through tine's effects gateway.\n",
    );
    for (k, v) in vars {
        sh.push_str(&format!("export {k}={v}\n"));
    }
    std::fs::create_dir_all("/etc/profile.d")?;
    std::fs::write("/etc/profile.d/tine-proxy.sh", sh)?;
    let env = std::fs::read_to_string("/etc/environment").unwrap_or_default();
    let mut add = String::new();
    for (k, v) in vars {
        if !env.lines().any(|l| l.starts_with(&format!("{k}="))) {
            add.push_str(&format!("{k}={v}\n"));
        }
    }
    if !add.is_empty() {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open("/etc/environment")?;
        if !env.is_empty() && !env.ends_with('\n') {
            f.write_all(b"\n")?;
        }
        f.write_all(add.as_bytes())?;
    }
    Ok(())
}

fn accept_loop(l: TcpListener) {
    loop {
        match l.accept() {
            Ok((tcp, _)) => {
                let spawned = std::thread::Builder::new()
                    .name("tine-agent-pipe".into())
                    .spawn(move || pipe(tcp));
                if let Err(e) = spawned {
                    eprintln!("tine-agent: proxy: cannot start a pipe thread: {e}");
                }
            }
            Err(e) => {
                eprintln!("tine-agent: proxy: accept: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// A connected vsock stream socket to the host.
struct Vsock(File);

impl Vsock {
    fn connect(cid: u32, port: u32) -> io::Result<Self> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw =
            unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh socket fd that nothing else owns.
        let f = unsafe { File::from_raw_fd(raw) };
        let addr = libc::sockaddr_vm {
            svm_family: libc::AF_VSOCK as libc::sa_family_t,
            svm_reserved1: 0,
            svm_port: port,
            svm_cid: cid,
            svm_zero: [0; 4],
        };
        loop {
            // SAFETY: `addr` is a valid sockaddr_vm and the length matches it.
            let rc = unsafe {
                libc::connect(
                    raw,
                    (&addr as *const libc::sockaddr_vm).cast(),
                    std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                return Ok(Vsock(f));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    fn try_clone(&self) -> io::Result<Self> {
        Ok(Vsock(self.0.try_clone()?))
    }

    fn shutdown(&self, how: libc::c_int) {
        // SAFETY: shutdown(2) on the socket this value owns.
        unsafe {
            libc::shutdown(self.0.as_raw_fd(), how);
        }
    }
}

/// Makes the connection's close send a reset: the program sees an error,
/// not a clean end it could take for a whole response.
fn reset(tcp: &TcpStream) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt(2) with a valid linger struct and its size, on a
    // socket `tcp` owns.
    unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    let _ = tcp.shutdown(Shutdown::Read);
}

/// Pipes one program's connection to the gateway and back.
fn pipe(tcp: TcpStream) {
    let _ = tcp.set_nodelay(true);
    let vs = match Vsock::connect(HOST_CID, HOST_PORT) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("tine-agent: proxy: the host's gateway does not answer: {e}");
            reset(&tcp);
            return;
        }
    };
    let (Ok(mut tcp_in), Ok(mut vs_out)) = (tcp.try_clone(), vs.try_clone()) else {
        reset(&tcp);
        return;
    };
    // Program -> gateway; its end is the program's end of sending. It
    // looks up once a second whether the other way is done (a program that
    // never closes must not keep the thread).
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done2 = done.clone();
    let _ = tcp_in.set_read_timeout(Some(std::time::Duration::from_secs(1)));
    let up = std::thread::Builder::new()
        .name("tine-agent-pipe-up".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match tcp_in.read(&mut buf) {
                    Ok(0) => {
                        vs_out.shutdown(libc::SHUT_WR);
                        return;
                    }
                    Ok(n) => {
                        if vs_out.0.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        if done2.load(std::sync::atomic::Ordering::Relaxed) {
                            return;
                        }
                    }
                    Err(_) => {
                        vs_out.shutdown(libc::SHUT_RDWR);
                        return;
                    }
                }
            }
        });
    // Gateway -> program: a clean end is passed on as one; a broken vsock
    // stream (transport reset) resets the program's connection.
    let mut vs_in = vs;
    let mut tcp_out = tcp;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match vs_in.0.read(&mut buf) {
            Ok(0) => {
                let _ = tcp_out.shutdown(Shutdown::Write);
                break;
            }
            Ok(n) => {
                if tcp_out.write_all(&buf[..n]).is_err() {
                    vs_in.shutdown(libc::SHUT_RDWR);
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                reset(&tcp_out);
                vs_in.shutdown(libc::SHUT_RDWR);
                break;
            }
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Ok(t) = up {
        let _ = t.join();
    }
}
