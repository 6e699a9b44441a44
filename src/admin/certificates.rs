//! `/api/v1/certificates`: certificates the HTTPS listener serves by SNI. Admin only; the
//! private key is accepted on create and never returned.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Admin;
use super::error::{ApiError, ErrorBody};
use super::extract::{ApiJson, IdPath, PageQuery, Pagination};
use super::{AdminState, List};
use crate::model::{Certificate, CertificateSpec};
use crate::store::NewCertificate;
use crate::validate;

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(list_certificates, create_certificate))
        .routes(routes!(
            get_certificate,
            replace_certificate,
            delete_certificate
        ))
}

#[utoipa::path(get, path = "/certificates", tag = "certificates", params(PageQuery),
    responses((status = 200, body = List<Certificate>), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)))]
async fn list_certificates(
    _: Admin,
    State(state): State<AdminState>,
    Pagination(page): Pagination,
) -> Result<Json<List<Certificate>>, ApiError> {
    let items = state.store.list_certificates(page).await?;
    Ok(Json(List::new(items, page, |c| c.id)))
}

/// Takes effect on the HTTPS listener without a restart once this returns.
#[utoipa::path(post, path = "/certificates", tag = "certificates", request_body = CertificateSpec,
    responses((status = 201, body = Certificate), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn create_certificate(
    _: Admin,
    State(state): State<AdminState>,
    ApiJson(spec): ApiJson<CertificateSpec>,
) -> Result<(StatusCode, Json<Certificate>), ApiError> {
    let (spec, parsed) = validate::certificate(spec)?;
    let snis = spec.snis.unwrap_or_default();
    let certificate = state
        .store
        .create_certificate(&NewCertificate {
            snis: &snis,
            cert_pem: &spec.cert_pem,
            key_pem: &spec.key_pem,
            not_after: parsed.not_after,
        })
        .await?;
    state.apply().await?;
    Ok((StatusCode::CREATED, Json(certificate)))
}

#[utoipa::path(get, path = "/certificates/{id}", tag = "certificates",
    responses((status = 200, body = Certificate), (status = 404, body = ErrorBody)))]
async fn get_certificate(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<Certificate>, ApiError> {
    Ok(Json(state.store.get_certificate(id).await?))
}

/// Replaces the certificate, key and names at once (a renewal): handshakes switch to the new
/// certificate without a moment in which its names fall back to the default.
#[utoipa::path(put, path = "/certificates/{id}", tag = "certificates", request_body = CertificateSpec,
    responses((status = 200, body = Certificate), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn replace_certificate(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    ApiJson(spec): ApiJson<CertificateSpec>,
) -> Result<Json<Certificate>, ApiError> {
    let (spec, parsed) = validate::certificate(spec)?;
    let snis = spec.snis.unwrap_or_default();
    let certificate = state
        .store
        .update_certificate(
            id,
            &NewCertificate {
                snis: &snis,
                cert_pem: &spec.cert_pem,
                key_pem: &spec.key_pem,
                not_after: parsed.not_after,
            },
        )
        .await?;
    state.apply().await?;
    Ok(Json(certificate))
}

#[utoipa::path(delete, path = "/certificates/{id}", tag = "certificates",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_certificate(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<StatusCode, ApiError> {
    state.store.delete_certificate(id).await?;
    state.apply().await?;
    Ok(StatusCode::NO_CONTENT)
}
