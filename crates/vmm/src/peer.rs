//! Who may connect to a VMM's sockets (control, vsock, console): its own
//! user or root, by SO_PEERCRED. A jailed VMM runs as its tree's own uid,
//! so the VMM of another tree (or any other user of the host) is refused:
//! the vsock socket is a root shell in a Linux guest, the console its
//! keyboard.

/// Refuses a peer that is neither this process's user nor root.
pub fn check_peer(conn: &impl std::os::fd::AsFd) -> Result<(), String> {
    let cred = nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| format!("cannot read the peer's credentials: {e}"))?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() == me || cred.uid() == 0 {
        Ok(())
    } else {
        Err(format!(
            "uid {} may not use this vm's sockets (they belong to uid {me})",
            cred.uid()
        ))
    }
}
