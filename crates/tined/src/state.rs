//! What every handler shares: the engine, operations, events, metrics and
//! idempotency answers, and the extractors and helpers handlers use to
//! read input and call the engine.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, ApiResult};
use crate::events::Events;
use crate::idem::Idempotency;
use crate::metrics::Metrics;
use crate::ops::Operations;

/// Largest JSON body accepted.
pub const MAX_JSON: usize = 4 << 20;

/// What every handler shares.
pub struct AppState {
    pub host: host::Host,
    pub ops: Operations,
    pub events: Events,
    pub metrics: Metrics,
    pub idem: Idempotency,
    pub started: Instant,
    /// Unix ms of the last request (for the idle exit).
    pub last_request: AtomicU64,
    /// Identifies this tined's build (the CLI restarts a stale daemon).
    pub build: String,
    /// Set by `POST /v1/shutdown`.
    pub shutdown: tokio::sync::Notify,
    /// Shutting down: new requests are refused (503), the ones in flight
    /// and the running operations finish first.
    pub draining: std::sync::atomic::AtomicBool,
    /// Requests being answered (streams not counted).
    pub in_flight: std::sync::atomic::AtomicUsize,
    /// API keys for TCP clients.
    pub keys: crate::keys::Keys,
    /// What the E2B-compatible API knows of its sandboxes and snapshots.
    pub e2b: crate::e2b::records::Records,
    /// This host in the fleet, once it registered.
    pub fleet: std::sync::OnceLock<Arc<crate::fleet::Member>>,
}

pub type Shared = Arc<AppState>;

impl AppState {
    /// The state of a tined serving `host` (fails when the stored API
    /// keys cannot be read: they must not vanish).
    pub fn new(host: host::Host, build: String) -> anyhow::Result<Shared> {
        Ok(Arc::new(AppState {
            keys: crate::keys::Keys::open(&host.home)?,
            e2b: crate::e2b::records::Records::open(&host.home),
            idem: Idempotency::new(&host.home),
            host,
            ops: Operations::default(),
            events: Events::default(),
            metrics: Metrics::default(),
            started: Instant::now(),
            last_request: AtomicU64::new(host::state::now_ms()),
            build,
            shutdown: tokio::sync::Notify::new(),
            draining: std::sync::atomic::AtomicBool::new(false),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            fleet: std::sync::OnceLock::new(),
        }))
    }
}

/// Writes a file only its owner may read (mode 0600 from its creation,
/// whatever the umask), whole or not at all: a new file renamed over the
/// old one. For tined's files that hold secrets (keys, envd tokens).
pub fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes).and_then(|()| f.sync_all())?;
    std::fs::rename(&tmp, path)
}

/// A JSON body, parsed with a clear error (and a size limit).
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let body = read_limited(req, state, MAX_JSON).await?;
        parse_json(&body).map(JsonBody)
    }
}

/// How much of a body over the limit is still read (and dropped) before
/// the 413 is sent, so that a client still sending it reads the answer
/// instead of a reset connection.
const DRAIN: usize = 16 << 20;

/// How long that may take.
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// The body of `req`, at most `limit` bytes.
pub async fn read_limited<S: Send + Sync>(
    req: Request,
    _state: &S,
    limit: usize,
) -> ApiResult<Bytes> {
    use http_body_util::BodyExt;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("the request body is larger than {limit} bytes"),
        )
    };
    let announced = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut body = req.into_body();
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| ApiError::invalid(format!("cannot read the request body: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if buf.len() + data.len() > limit {
            let mut seen = buf.len() + data.len();
            let hopeless = announced.is_some_and(|n| n > (limit + DRAIN) as u64);
            if !hopeless {
                let _ = tokio::time::timeout(DRAIN_TIME, async {
                    while seen <= limit + DRAIN {
                        match body.frame().await {
                            Some(Ok(f)) => {
                                seen += f.data_ref().map(|d| d.len()).unwrap_or(0);
                            }
                            _ => break,
                        }
                    }
                })
                .await;
            }
            return Err(too_large());
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

/// Parses a JSON body; an empty body is `{}`.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(format!(
            "the request body is not valid JSON for this call: {e}"
        ))
    })
}

/// Engine calls on the blocking pool that have not returned, those whose
/// client went away (and whose handler was dropped) included.
static ENGINE_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many engine calls run now (see [`blocking`]).
pub fn engine_calls() -> usize {
    ENGINE_CALLS.load(std::sync::atomic::Ordering::SeqCst)
}

/// Counts one engine call from its request until it returned.
struct EngineCall;

impl EngineCall {
    fn new() -> EngineCall {
        ENGINE_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        EngineCall
    }
}

impl Drop for EngineCall {
    fn drop(&mut self) {
        ENGINE_CALLS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

tokio::task_local! {
    /// Microseconds the request being answered spent in engine calls
    /// ([`blocking`]), for its `Server-Timing` header (router.rs).
    pub static ENGINE_US: std::cell::Cell<u64>;
}

/// Runs an engine call. On tined's multi-threaded runtime it runs right
/// here, on this worker thread (`block_in_place`: the worker's other tasks
/// move to another thread meanwhile), not on the blocking pool: handing
/// the call to a pool thread and the answer back costs two thread wake-ups
/// per request, most of the API's cost over the engine on a loaded host
/// (bench/api). Either way the call runs to its end even if the client
/// goes away (a future cannot be dropped in the middle of it), and until
/// then it counts in [`engine_calls`], which a shutdown waits for.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> host::Result<T> + Send + 'static,
) -> ApiResult<T> {
    let call = EngineCall::new();
    let timed = move || {
        let _call = call;
        let t = Instant::now();
        // A panic is an answer (500), as from a pool thread.
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        (res, t.elapsed())
    };
    let multi = tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::MultiThread;
    let (res, took) = if multi {
        tokio::task::block_in_place(timed)
    } else {
        tokio::task::spawn_blocking(timed)
            .await
            .map_err(|e| ApiError::internal(format!("the operation's thread died: {e}")))?
    };
    // Outside a request (no scope) there is nothing to report to.
    let _ = ENGINE_US.try_with(|c| c.set(c.get() + took.as_micros() as u64));
    res.map_err(|_| ApiError::internal("the operation panicked (see tined.log)"))?
        .map_err(ApiError::from)
}
