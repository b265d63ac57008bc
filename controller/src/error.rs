//! API errors: each has a stable machine-readable reason, an HTTP status, and a message that
//! says what was wrong and with which field.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keelson_api::validate::ValidationError;
use keelson_api::wire::ErrorBody;

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    Invalid { field: Option<String>, message: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    Gone(String),
    #[error("{0}")]
    Internal(String),
    #[error("{0}")]
    Unavailable(String),
}

impl ApiError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        let field = field.into();
        ApiError::Invalid { field: (!field.is_empty()).then_some(field), message: message.into() }
    }

    /// The stable reason, as it appears in error bodies and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            ApiError::Invalid { .. } => "Invalid",
            ApiError::NotFound(_) => "NotFound",
            ApiError::Conflict(_) => "Conflict",
            ApiError::Unauthorized(_) => "Unauthorized",
            ApiError::Forbidden(_) => "Forbidden",
            ApiError::TooLarge(_) => "TooLarge",
            ApiError::Gone(_) => "Gone",
            ApiError::Internal(_) => "Internal",
            ApiError::Unavailable(_) => "Unavailable",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Invalid { .. } => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Gone(_) => StatusCode::GONE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl From<ValidationError> for ApiError {
    fn from(e: ValidationError) -> Self {
        let field = e.field().to_owned();
        ApiError::Invalid { field: (!field.is_empty()).then_some(field), message: e.to_string() }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict { .. } => ApiError::Conflict(e.to_string()),
            StoreError::Compacted { .. } => ApiError::Gone(format!("{e}; list again and watch from the list's resourceVersion")),
            StoreError::Backend(_) => ApiError::Internal(e.to_string()),
            StoreError::Closed | StoreError::Unavailable(_) => ApiError::Unavailable(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if matches!(self, ApiError::Internal(_)) {
            tracing::error!(error = %self, "internal error");
        }
        let body = ErrorBody {
            reason: self.reason().to_owned(),
            field: match &self {
                ApiError::Invalid { field, .. } => field.clone(),
                _ => None,
            },
            message: self.to_string(),
        };
        (self.status(), axum::Json(body)).into_response()
    }
}
