//! Listening: the Unix socket (mode 0600: only the owner reaches it, no
//! token) and an optional TCP listener on which every request needs the
//! token tined was started with or an API key it issued (keys.rs), as
//! `Authorization: Bearer ...` or E2B's `X-API-Key`; an E2B sandbox's
//! envd requests may carry its own access token instead (`X-Access-Token`),
//! which opens that sandbox's envd and nothing else. Each request gets a
//! [`Caller`] extension saying which it was. Connections are served by
//! hyper with upgrades (for `attach`).

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
        // The socket is 0600 in a 0700 home; the peer's uid is checked
        // too, so a mode changed by hand or a shared home opens nothing.
        if let Err(e) = vmm::peer::check_peer(&stream) {
            tracing::warn!("refused a connection to tined.sock: {e}");
            continue;
        }
        let app = app.clone();
        let stop = stop.clone();
        tokio::spawn(async move { connection(stream, app, None, stop).await });
    }
}

/// Who may use the TCP listener.
pub struct Auth {
    /// The token tined was started with (`--token-file`): the owner's.
    pub token: Option<String>,
    /// Where the API keys and the E2B sandboxes' envd tokens are.
    pub state: crate::state::Shared,
}

/// Who a request comes from (a request extension).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// The host's owner: the Unix socket, or the token tined was started with.
    Owner,
    /// A client with an API key tined issued.
    Key,
    /// An E2B sandbox's envd access token: that sandbox's envd only.
    Sandbox,
}

impl Auth {
    /// Who sent a request with these headers to `path`, if anyone we know.
    fn caller(&self, headers: &axum::http::HeaderMap, path: &str) -> Option<Caller> {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let bearer = header("authorization")
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim());
        let presented = [bearer, header("x-api-key")];
        if let Some(t) = &self.token {
            let mut all = presented.into_iter().chain([header("x-access-token")]);
            if all.any(|v| v.is_some_and(|v| crate::keys::same(v.as_bytes(), t.as_bytes()))) {
                return Some(Caller::Owner);
            }
        }
        if presented
            .into_iter()
            .flatten()
            .any(|v| self.state.keys.check(v).is_some())
        {
            return Some(Caller::Key);
        }
        let sandbox = header("e2b-sandbox-id");
        match (sandbox, header("x-access-token")) {
            (Some(id), Some(t))
                if crate::e2b::is_envd_path(path) && self.state.e2b.envd_token_is(id, t) =>
            {
                Some(Caller::Sandbox)
            }
            _ => None,
        }
    }
}

impl Auth {
    /// The answer to an envd request for a sandbox tined has no record of
    /// (killed, or never made): 502, as E2B's proxy answers it.
    fn gone_sandbox(
        &self,
        headers: &axum::http::HeaderMap,
        path: &str,
    ) -> Option<axum::response::Response> {
        let id = headers.get("e2b-sandbox-id")?.to_str().ok()?;
        if !crate::e2b::is_envd_path(path) || self.state.e2b.sandbox(id).is_some() {
            return None;
        }
        let e = crate::e2b::E2bError(
            axum::http::StatusCode::BAD_GATEWAY,
            format!("sandbox {id:?} was not found"),
        );
        Some(axum::response::IntoResponse::into_response(e))
    }
}

/// Serves `app` over TCP, each request checked by `auth`, until `stop`.
pub async fn tcp(
    listener: tokio::net::TcpListener,
    app: Router,
    auth: Arc<Auth>,
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
        let auth = auth.clone();
        let stop = stop.clone();
        tokio::spawn(async move { connection(stream, app, Some(auth), stop).await });
    }
}

async fn connection<S>(
    stream: S,
    app: Router,
    auth: Option<Arc<Auth>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(
        move |mut req: hyper::Request<hyper::body::Incoming>| {
            let app = app.clone();
            let auth = auth.clone();
            async move {
                let caller = match &auth {
                    None => Some(Caller::Owner),
                    Some(a) => a.caller(req.headers(), req.uri().path()),
                };
                let Some(caller) = caller else {
                    // A sandbox that is gone (or never was) is what E2B's
                    // proxy says it is, whatever the token: not found.
                    let gone = auth
                        .as_ref()
                        .and_then(|a| a.gone_sandbox(req.headers(), req.uri().path()));
                    if let Some(res) = gone {
                        return Ok(res);
                    }
                    let mut res = axum::response::IntoResponse::into_response(ApiError::unauthorized(
                    "this listener needs `Authorization: Bearer KEY` or `X-API-Key: KEY` (an API key from `tine keys create`, or the token tined was started with)",
                ));
                    res.headers_mut().insert(
                        axum::http::header::WWW_AUTHENTICATE,
                        axum::http::HeaderValue::from_static("Bearer realm=\"tined\""),
                    );
                    return Ok::<_, std::convert::Infallible>(res);
                };
                req.extensions_mut().insert(caller);
                app.oneshot(req.map(axum::body::Body::new)).await
            }
        },
    );
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
