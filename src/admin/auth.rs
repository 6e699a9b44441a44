//! Bearer-token authentication with two roles. Tokens are stored as SHA-256 hashes only.

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use rand::RngCore;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::AdminState;
use crate::model::{Role, Token, TokenSpec};
use crate::store::{Store, StoreError};

const TOKEN_PREFIX: &str = "raahi_";
/// The stored record of the token given as `admin.token` / `RAAHI_ADMIN_TOKEN`.
const CONFIGURED_TOKEN_NAME: &str = "configured-admin";

/// A new random secret: 32 bytes from the OS generator, hex encoded.
pub fn generate_token() -> String {
    let mut secret = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut secret);
    format!("{TOKEN_PREFIX}{}", hex::encode(secret))
}

pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Creates a token, returning the stored record and the secret (shown once).
pub async fn create_token(store: &Store, spec: &TokenSpec) -> Result<(Token, String), StoreError> {
    let secret = generate_token();
    let token = store.create_token(spec, &hash_token(&secret)).await?;
    Ok((token, secret))
}

/// How the first start got its admin token.
pub enum Bootstrap {
    /// No token existed: a new admin token was generated; print it once.
    Generated(String),
    /// The configured `admin.token` is (now) a stored admin token.
    Configured,
    /// Tokens exist already and none is configured.
    Existing,
}

/// Makes sure an admin can log in: registers the configured token, or generates one on a
/// store without tokens.
pub async fn bootstrap(store: &Store, configured: Option<&str>) -> Result<Bootstrap, StoreError> {
    if let Some(secret) = configured {
        // One configured token at a time: a new `admin.token` replaces (and so revokes) the
        // previous one.
        let hash = hash_token(secret);
        if store.find_token_by_hash(&hash).await?.is_none() {
            let spec = TokenSpec {
                name: CONFIGURED_TOKEN_NAME.to_owned(),
                role: Role::Admin,
            };
            store.upsert_token_by_name(&spec, &hash).await?;
        }
        return Ok(Bootstrap::Configured);
    }
    if store.count_tokens().await? > 0 {
        return Ok(Bootstrap::Existing);
    }
    let spec = TokenSpec {
        name: "initial-admin".to_owned(),
        role: Role::Admin,
    };
    match create_token(store, &spec).await {
        Ok((_, secret)) => Ok(Bootstrap::Generated(secret)),
        // Another instance starting on the same empty database created it first (and printed
        // its secret): this one has a token to use too.
        Err(StoreError::Conflict { .. }) => Ok(Bootstrap::Existing),
        Err(other) => Err(other),
    }
}

async fn caller_token(parts: &Parts, state: &AdminState) -> Result<Token, ApiError> {
    let secret = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| {
            let (scheme, token) = value.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .filter(|token| !token.is_empty())
        .ok_or(ApiError::Unauthorized)?;
    state
        .store
        .find_token_by_hash(&hash_token(secret))
        .await?
        .ok_or(ApiError::Unauthorized)
}

async fn caller_role(parts: &Parts, state: &AdminState) -> Result<Role, ApiError> {
    caller_token(parts, state).await.map(|token| token.role)
}

/// The caller's token (any valid one), for `/session`.
pub struct Caller(pub Token);

impl FromRequestParts<AdminState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AdminState) -> Result<Self, ApiError> {
        caller_token(parts, state).await.map(Caller)
    }
}

/// Any valid token (viewer or admin).
pub struct Viewer;

/// A token with the admin role.
pub struct Admin;

impl FromRequestParts<AdminState> for Viewer {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AdminState) -> Result<Self, ApiError> {
        caller_role(parts, state).await.map(|_| Viewer)
    }
}

impl FromRequestParts<AdminState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AdminState) -> Result<Self, ApiError> {
        match caller_role(parts, state).await? {
            Role::Admin => Ok(Admin),
            Role::Viewer => Err(ApiError::Forbidden),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_hashes_stable() {
        let a = generate_token();
        let b = generate_token();
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX));
        assert_eq!(hash_token(&a), hash_token(&a));
        assert_ne!(hash_token(&a), hash_token(&b));
        assert_eq!(hash_token(&a).len(), 64);
    }
}
