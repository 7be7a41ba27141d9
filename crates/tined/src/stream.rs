//! Server-sent event streams: the lifecycle events of the host, and one
//! operation's progress until it finishes.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::stream::{self, Stream, StreamExt};

use crate::error::{ApiError, ApiResult};
use crate::state::Shared;

#[utoipa::path(get, path = "/v1/events", tag = "events",
    responses((status = 200, description = "text/event-stream of lifecycle Events (event: the type, data: the Event as JSON)",
        content_type = "text/event-stream", body = crate::events::Event)))]
pub async fn events(State(s): State<Shared>) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let rx = s.events.subscribe();
    let stream = stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(e) => {
                    let data = serde_json::to_string(&e).unwrap_or_default();
                    return Some((Ok(Event::default().event(e.kind.clone()).data(data)), rx));
                }
                // A slow reader missed some: it goes on with the next.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

#[utoipa::path(get, path = "/v1/operations/{id}/events", tag = "operations",
    params(("id" = String, Path)),
    responses((status = 200, description = "text/event-stream: `progress` events, then one `done` event with the Operation",
        content_type = "text/event-stream", body = crate::ops::Operation)))]
pub async fn operation_events(
    State(s): State<Shared>,
    Path(id): Path<String>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let op = s
        .ops
        .get(&id)
        .ok_or_else(|| ApiError::not_found(format!("no operation {id:?} (see /v1/operations)")))?;
    let rx = op.subscribe();
    // The final state as soon as it is reached; progress at most every
    // 100 ms (the pause comes after a progress event, never before the
    // end, so a client waiting for a 5 ms operation waits 5 ms).
    #[derive(Clone, Copy, PartialEq)]
    enum Next {
        /// Read the state now (the first event).
        Look,
        /// Wait for the state to change.
        Change,
        /// Pause after a progress event, then read.
        Pause,
    }
    let stream = stream::unfold((rx, Some(Next::Look)), |(mut rx, next)| async move {
        match next? {
            Next::Look => {}
            Next::Change => rx.changed().await.ok()?,
            Next::Pause => tokio::time::sleep(Duration::from_millis(100)).await,
        }
        let cur = rx.borrow_and_update().clone();
        if cur.state != crate::ops::OpState::Running {
            let data = serde_json::to_string(&cur).unwrap_or_default();
            return Some((Ok(Event::default().event("done").data(data)), (rx, None)));
        }
        let data = serde_json::to_string(&cur.progress).unwrap_or_default();
        let then = if next == Some(Next::Change) {
            Next::Pause
        } else {
            Next::Change
        };
        Some((
            Ok(Event::default().event("progress").data(data)),
            (rx, Some(then)),
        ))
    })
    .boxed();
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
