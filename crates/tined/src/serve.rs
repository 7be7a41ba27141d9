//! Listening: the Unix socket (mode 0600: only the owner reaches it, no
//! token) and an optional TCP listener on which every request needs
//! `Authorization: Bearer TOKEN`. Connections are served by hyper with
//! upgrades (for `attach`).

use std::path::Path;
use std::sync::Arc;

use axum::Router;
use hyper_util::rt::TokioIo;
use tower::ServiceExt;

use crate::error::ApiError;

/// Tells the listeners and connections to stop, and how many are left.
pub struct Stop {
    tx: tokio::sync::watch::Sender<bool>,
}

impl Default for Stop {
    fn default() -> Self {
        Stop {
            tx: tokio::sync::watch::channel(false).0,
        }
    }
}

impl Stop {
    /// What a listener (and each of its connections) watches.
    pub fn watcher(&self) -> tokio::sync::watch::Receiver<bool> {
        self.tx.subscribe()
    }

    /// Stops accepting, lets every connection finish the request it is
    /// answering (its answer is written before it closes), and waits up to
    /// `limit` for them (streams that never end are cut off after it).
    pub async fn stop(&self, limit: std::time::Duration) {
        let _ = self.tx.send(true);
        let _ = tokio::time::timeout(limit, async {
            while self.tx.receiver_count() > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await;
    }
}

/// Serves `app` on every connection `listener` accepts until `stop`.
pub async fn unix(
    listener: tokio::net::UnixListener,
    app: Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let app = app.clone();
        let stop = stop.clone();
        tokio::spawn(async move { connection(stream, app, None, stop).await });
    }
}

/// Serves `app` over TCP, each request checked against `token`, until `stop`.
pub async fn tcp(
    listener: tokio::net::TcpListener,
    app: Router,
    token: Arc<String>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let token = token.clone();
        let stop = stop.clone();
        tokio::spawn(async move { connection(stream, app, Some(token), stop).await });
    }
}

async fn connection<S>(
    stream: S,
    app: Router,
    token: Option<Arc<String>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let app = app.clone();
        let token = token.clone();
        async move {
            if let Some(t) = &token {
                if !authorized(req.headers(), t) {
                    let mut res = axum::response::IntoResponse::into_response(ApiError::unauthorized(
                        "this listener needs `Authorization: Bearer TOKEN` (the token tined was started with)",
                    ));
                    res.headers_mut().insert(
                        axum::http::header::WWW_AUTHENTICATE,
                        axum::http::HeaderValue::from_static("Bearer realm=\"tined\""),
                    );
                    return Ok::<_, std::convert::Infallible>(res);
                }
            }
            app.oneshot(req.map(axum::body::Body::new)).await
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            res = conn.as_mut() => {
                if let Err(e) = res {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                // Finish the request in flight (its answer is written),
                // then close; an idle connection closes at once.
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Constant-time comparison of the bearer token (the scheme's name is
/// case-insensitive, RFC 7235).
/// Whether a request carries the token: `Authorization: Bearer TOKEN`, or
/// E2B's headers for it (`X-API-Key` to the control API, `X-Access-Token`
/// to envd: the e2b SDK sends the key it was given and the access token
/// POST /sandboxes answered, which is this token).
fn authorized(headers: &axum::http::HeaderMap, token: &str) -> bool {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let bearer = header("authorization")
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    [bearer, header("x-api-key"), header("x-access-token")]
        .into_iter()
        .flatten()
        .any(|v| same(v.as_bytes(), token.as_bytes()))
}

/// Compares in time independent of where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Binds the Unix socket at `path` with mode 0600 (a stale socket of a
/// dead tined is replaced; the home lock says none runs).
pub fn bind_unix(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    let _ = std::fs::remove_file(path);
    // Created with no permissions for anyone but the owner from the
    // start: there is no window in which another user could connect.
    // SAFETY: umask(2) only changes this process's file mode mask.
    let old = unsafe { libc::umask(0o177) };
    let l = std::os::unix::net::UnixListener::bind(path);
    // SAFETY: as above, restoring it.
    unsafe { libc::umask(old) };
    let l = l?;
    l.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_authorized_needs_the_exact_token() {
        let mut h = axum::http::HeaderMap::new();
        assert!(!authorized(&h, "secret"));
        h.insert("authorization", "Bearer secret".parse().expect("header"));
        assert!(authorized(&h, "secret"));
        assert!(!authorized(&h, "secreT"));
        assert!(!authorized(&h, "secret2"));
        h.insert("authorization", "Basic secret".parse().expect("header"));
        assert!(!authorized(&h, "secret"));
        h.insert("authorization", "bearer secret".parse().expect("header"));
        assert!(authorized(&h, "secret"));
        h.insert("authorization", "Bearer".parse().expect("header"));
        assert!(!authorized(&h, "secret"));
        h.insert("authorization", "Bearer ".parse().expect("header"));
        assert!(!authorized(&h, "secret"));
    }
}
