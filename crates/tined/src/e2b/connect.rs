//! Connect RPC as envd speaks it to the e2b SDK: the JSON codec (proto3
//! JSON: camelCase fields, bytes as base64, enums by name), no
//! compression. Unary calls are a JSON body each way; streams are
//! envelopes (a flags byte, a big-endian u32 length, JSON), the last one
//! flagged end-of-stream and carrying the error, if any. Written here
//! rather than taken from a crate: the Rust Connect implementations
//! generate code from the .proto files with protoc, which is not at hand,
//! and the JSON codec needs only these few lines.

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// The flag of a stream's last envelope.
pub const END_STREAM: u8 = 0x02;
/// The flag of a compressed envelope (never sent; refused when received).
const COMPRESSED: u8 = 0x01;
/// Largest envelope accepted from a client.
const MAX_MESSAGE: usize = 16 << 20;

/// Connect's error codes (those envd answers with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// A code by its name (one of these).
    pub fn parse(name: &str) -> Option<Code> {
        [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::PermissionDenied,
            Code::FailedPrecondition,
            Code::Unimplemented,
            Code::Internal,
            Code::Unavailable,
            Code::Unauthenticated,
        ]
        .into_iter()
        .find(|c| c.as_str() == name)
    }

    /// The HTTP status of a unary error (the Connect protocol's table).
    fn status(self) -> StatusCode {
        match self {
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    /// The code for one of tined's errors.
    pub fn of(status: StatusCode) -> Code {
        match status {
            StatusCode::NOT_FOUND => Code::NotFound,
            StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => Code::InvalidArgument,
            StatusCode::CONFLICT => Code::FailedPrecondition,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::BAD_GATEWAY => Code::Unavailable,
            StatusCode::UNAUTHORIZED => Code::Unauthenticated,
            StatusCode::NOT_IMPLEMENTED => Code::Unimplemented,
            _ => Code::Internal,
        }
    }
}

/// An RPC's failure: a code and a message for a human.
#[derive(Debug)]
pub struct RpcError(pub Code, pub String);

impl RpcError {
    pub fn invalid(msg: impl Into<String>) -> RpcError {
        RpcError(Code::InvalidArgument, msg.into())
    }
    pub fn unimplemented(what: &str) -> RpcError {
        RpcError(
            Code::Unimplemented,
            format!("tine's envd does not support {what}"),
        )
    }
}

impl From<crate::error::ApiError> for RpcError {
    fn from(e: crate::error::ApiError) -> RpcError {
        RpcError(Code::of(e.status), e.body.message)
    }
}

/// A unary error answer.
impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        let body = json!({"code": self.0.as_str(), "message": self.1});
        (self.0.status(), Json(body)).into_response()
    }
}

/// One envelope of a streamed answer.
pub fn envelope(flags: u8, v: &Value) -> Bytes {
    let data = serde_json::to_vec(v).unwrap_or_default();
    let mut out = Vec::with_capacity(5 + data.len());
    out.push(flags);
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(&data);
    Bytes::from(out)
}

/// The end of a stream: with an error, or a clean end.
pub fn end(error: Option<RpcError>) -> Bytes {
    match error {
        Some(RpcError(code, message)) => envelope(
            END_STREAM,
            &json!({"error": {"code": code.as_str(), "message": message}}),
        ),
        None => envelope(END_STREAM, &json!({})),
    }
}

/// A streamed answer whose body is `body`.
pub fn stream(body: Body) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/connect+json")],
        body,
    )
        .into_response()
}

/// A streamed answer that is only its end, with an error (a stream's
/// errors travel in its body: the status stays 200).
pub fn stream_error(e: RpcError) -> Response {
    stream(Body::from(end(Some(e))))
}

/// Reads envelopes from a client's stream as its bytes arrive.
#[derive(Default)]
pub struct Envelopes {
    buf: Vec<u8>,
}

impl Envelopes {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole envelope's flags and message, if one has arrived.
    pub fn next(&mut self) -> Option<Result<(u8, Value), RpcError>> {
        if self.buf.len() < 5 {
            return None;
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_MESSAGE {
            return Some(Err(RpcError::invalid(format!(
                "a message of {len} bytes is over the {MAX_MESSAGE}-byte limit"
            ))));
        }
        if self.buf.len() < 5 + len {
            return None;
        }
        let msg: Vec<u8> = self.buf.drain(..5 + len).skip(5).collect();
        if flags & COMPRESSED != 0 {
            return Some(Err(RpcError::invalid(
                "compressed messages are not accepted (send them uncompressed)",
            )));
        }
        Some(
            serde_json::from_slice(&msg)
                .map(|v| (flags, v))
                .map_err(|e| RpcError::invalid(format!("a message is not JSON: {e}"))),
        )
    }

    /// Bytes left that make no whole envelope.
    pub fn rest(&self) -> usize {
        self.buf.len()
    }
}

/// The one request message of a server-streaming call (an envelope; a
/// bare JSON body is taken too).
pub fn stream_request(body: &[u8]) -> Result<Value, RpcError> {
    if body.first() == Some(&b'{') {
        return serde_json::from_slice(body)
            .map_err(|e| RpcError::invalid(format!("the request is not JSON: {e}")));
    }
    let mut e = Envelopes::default();
    e.push(body);
    match e.next() {
        Some(Ok((_, v))) => Ok(v),
        Some(Err(err)) => Err(err),
        None => serde_json::from_slice(body)
            .map_err(|_| RpcError::invalid("the request is not a Connect envelope of JSON")),
    }
}

/// A unary call's request (an empty body is `{}`).
pub fn unary_request(body: &[u8]) -> Result<Value, RpcError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| {
        RpcError::invalid(format!(
            "the request is not JSON ({e}); tine's envd speaks Connect's JSON codec"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_envelopes_arrive_in_pieces() {
        let a = envelope(0, &json!({"a": 1}));
        let b = end(None);
        let mut wire = a.to_vec();
        wire.extend_from_slice(&b);
        let mut e = Envelopes::default();
        for chunk in wire.chunks(3) {
            e.push(chunk);
        }
        assert_eq!(e.next().map(|r| r.ok()), Some(Some((0, json!({"a": 1})))));
        assert_eq!(
            e.next().map(|r| r.ok()),
            Some(Some((END_STREAM, json!({}))))
        );
        assert!(e.next().is_none());
        assert_eq!(e.rest(), 0);
        assert_eq!(&b[..], &[2, 0, 0, 0, 2, b'{', b'}']);
    }

    #[test]
    fn test_bad_envelopes_are_errors() {
        let mut e = Envelopes::default();
        e.push(&[1, 0, 0, 0, 2, b'{', b'}']);
        assert!(matches!(
            e.next(),
            Some(Err(RpcError(Code::InvalidArgument, _)))
        ));
        let mut e = Envelopes::default();
        e.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(
            e.next(),
            Some(Err(RpcError(Code::InvalidArgument, _)))
        ));
        let mut e = Envelopes::default();
        e.push(&[0, 0, 0, 0, 3, b'{', b'x', b'}']);
        assert!(matches!(
            e.next(),
            Some(Err(RpcError(Code::InvalidArgument, _)))
        ));
        assert!(stream_request(b"\x00\x00\x00").is_err());
        assert_eq!(
            stream_request(br#"{"process": {}}"#).ok(),
            Some(json!({"process": {}}))
        );
        assert_eq!(unary_request(b"  ").ok(), Some(json!({})));
    }
}
