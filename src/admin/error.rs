//! The one mapping from admin failures to HTTP statuses and JSON bodies.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::control::ControlError;
use crate::store::StoreError;

/// Classified by who failed: the client (4xx, do not retry unchanged) or the gateway's own
/// store or control task (503, retry later).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    Malformed { message: String },
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("this call needs the admin role")]
    Forbidden,
    #[error("{message}")]
    NotFound { message: String },
    #[error("{message}")]
    MethodNotAllowed { message: String },
    #[error("{message}")]
    Conflict {
        field: Option<String>,
        message: String,
    },
    #[error("request body is larger than {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("{message}")]
    Validation { field: String, message: String },
    #[error("{message}")]
    Unavailable { message: String },
}

impl From<crate::validate::ValidationError> for ApiError {
    fn from(error: crate::validate::ValidationError) -> ApiError {
        ApiError::Validation {
            field: error.field,
            message: error.message,
        }
    }
}

impl ApiError {
    pub fn validation(field: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::Validation {
            field: field.into(),
            message: message.into(),
        }
    }

    fn status(&self) -> StatusCode {
        match self {
            ApiError::Malformed { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden => StatusCode::FORBIDDEN,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Conflict { .. } => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Validation { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            ApiError::Malformed { .. } => "malformed_request",
            ApiError::Unauthorized => "unauthorized",
            ApiError::Forbidden => "forbidden",
            ApiError::NotFound { .. } => "not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::Conflict { .. } => "conflict",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::Validation { .. } => "validation_failed",
            ApiError::Unavailable { .. } => "unavailable",
        }
    }

    fn field(&self) -> Option<&str> {
        match self {
            ApiError::Conflict { field, .. } => field.as_deref(),
            ApiError::Validation { field, .. } => Some(field),
            _ => None,
        }
    }
}

/// `{"error": {"code": ..., "message": ..., "field": ...}}`
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
    pub field: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            tracing::error!(error = %self, "admin call failed on the gateway side");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code().to_owned(),
                message: self.to_string(),
                field: self.field().map(str::to_owned),
            },
        };
        let mut response = (status, axum::Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotFound { .. } => ApiError::NotFound {
                message: error.to_string(),
            },
            StoreError::Conflict { field, message } => ApiError::Conflict {
                field: Some(field.to_owned()),
                message,
            },
            StoreError::InvalidReference { field, message } => ApiError::Validation {
                field: field.into_owned(),
                message,
            },
            StoreError::Corrupt(_)
            | StoreError::UnsupportedUrl(_)
            | StoreError::Database(_)
            | StoreError::Migration(_) => ApiError::Unavailable {
                message: format!("the configuration store failed: {error}"),
            },
        }
    }
}

impl From<std::sync::Arc<ControlError>> for ApiError {
    fn from(error: std::sync::Arc<ControlError>) -> Self {
        ApiError::Unavailable {
            message: format!(
                "the change was saved but is not live yet ({error}); it goes live with the next successful rebuild"
            ),
        }
    }
}
