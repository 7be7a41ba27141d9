//! Errors as the API answers them: an HTTP status and a JSON body with a
//! code and the message a human should read.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// The body of every error answer.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// invalid_input, not_found, conflict, busy, failed, internal,
    /// unauthorized, too_large, method_not_allowed, restarting.
    pub code: String,
    /// What went wrong and what to do, for a human.
    pub message: String,
}

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            body: ErrorBody {
                code: code.into(),
                message: message.into(),
            },
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_input", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
}

impl From<host::Error> for ApiError {
    fn from(e: host::Error) -> Self {
        let code = e.code();
        let status = match code {
            host::Code::InvalidInput => StatusCode::BAD_REQUEST,
            host::Code::NotFound => StatusCode::NOT_FOUND,
            host::Code::Conflict | host::Code::Busy => StatusCode::CONFLICT,
            host::Code::Failed | host::Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, code.as_str(), e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body)).into_response()
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
