//! `/api/v1/tokens` (admin only, also for reading)

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{self, Admin};
use super::error::{ApiError, ErrorBody};
use super::extract::{ApiJson, IdPath, PageQuery, Pagination};
use super::{AdminState, List};
use crate::model::{Token, TokenSpec};
use crate::validate;

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(list_tokens, create_token))
        .routes(routes!(delete_token))
}

/// A new token; `token` is the secret and is shown only in this response, which no cache may
/// keep (`Cache-Control: no-store`).
#[derive(Serialize, ToSchema)]
pub struct CreatedToken {
    #[serde(flatten)]
    pub record: Token,
    pub token: String,
}

#[utoipa::path(get, path = "/tokens", tag = "tokens", params(PageQuery),
    responses((status = 200, body = List<Token>), (status = 403, body = ErrorBody)))]
async fn list_tokens(
    _: Admin,
    State(state): State<AdminState>,
    Pagination(page): Pagination,
) -> Result<Json<List<Token>>, ApiError> {
    let items = state.store.list_tokens(page).await?;
    Ok(Json(List::new(items, page, |t| t.id)))
}

#[utoipa::path(post, path = "/tokens", tag = "tokens", request_body = TokenSpec,
    responses((status = 201, body = CreatedToken), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn create_token(
    _: Admin,
    State(state): State<AdminState>,
    ApiJson(spec): ApiJson<TokenSpec>,
) -> Result<
    (
        StatusCode,
        [(header::HeaderName, HeaderValue); 1],
        Json<CreatedToken>,
    ),
    ApiError,
> {
    let spec = validate::token(spec)?;
    let (record, token) = auth::create_token(&state.store, &spec).await?;
    Ok((
        StatusCode::CREATED,
        [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))],
        Json(CreatedToken { record, token }),
    ))
}

#[utoipa::path(delete, path = "/tokens/{id}", tag = "tokens",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_token(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<StatusCode, ApiError> {
    state.store.delete_token(id).await?;
    Ok(StatusCode::NO_CONTENT)
}
