//! Admin API tokens, stored as hashes.

use super::rows::TokenRow;
use super::{convert_all, found, now_ms, unique_name_conflict, Page, Store, StoreError};
use crate::model::{Id, Token, TokenSpec};

impl Store {
    pub async fn count_tokens(&self) -> Result<i64, StoreError> {
        let (count,): (i64,) =
            on_pool!(self, |pool| sqlx::query_as("SELECT COUNT(*) FROM tokens")
                .fetch_one(pool)
                .await)?;
        Ok(count)
    }

    pub async fn list_tokens(&self, page: Page) -> Result<Vec<Token>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, TokenRow>(
            "SELECT * FROM tokens WHERE id > $1 ORDER BY id LIMIT $2"
        )
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    /// Stores a token by the hash of its secret; the secret itself is never stored.
    pub async fn create_token(
        &self,
        spec: &TokenSpec,
        token_hash: &str,
    ) -> Result<Token, StoreError> {
        let id = on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(
            "INSERT INTO tokens (name, role, token_hash, created_at) VALUES ($1, $2, $3, $4) RETURNING id",
        )
        .bind(&spec.name)
        .bind(spec.role.as_str())
        .bind(token_hash)
        .bind(now_ms())
        .fetch_one(pool)
        .await)
        .map_err(|e| unique_name_conflict(e, "token", &spec.name))?;
        let row = on_pool!(self, |pool| sqlx::query_as::<_, TokenRow>(
            "SELECT * FROM tokens WHERE id = $1"
        )
        .bind(id)
        .fetch_one(pool)
        .await)?;
        row.try_into()
    }

    /// Creates the token `spec.name`, or gives an existing one of that name this hash and role.
    pub async fn upsert_token_by_name(
        &self,
        spec: &TokenSpec,
        token_hash: &str,
    ) -> Result<(), StoreError> {
        on_pool!(self, |pool| {
            sqlx::query(
            "INSERT INTO tokens (name, role, token_hash, created_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT(name) DO UPDATE SET token_hash = excluded.token_hash, role = excluded.role",
        )
        .bind(&spec.name)
        .bind(spec.role.as_str())
        .bind(token_hash)
        .bind(now_ms())
        .execute(pool)
        .await
        .map(|done| done.rows_affected())
        })?;
        Ok(())
    }

    pub async fn find_token_by_hash(&self, token_hash: &str) -> Result<Option<Token>, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, TokenRow>(
            "SELECT * FROM tokens WHERE token_hash = $1"
        )
        .bind(token_hash)
        .fetch_optional(pool)
        .await)?
        .map(Token::try_from)
        .transpose()
    }

    pub async fn delete_token(&self, id: Id) -> Result<(), StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query("DELETE FROM tokens WHERE id = $1")
            .bind(id)
            .execute(pool)
            .await
            .map(|done| done.rows_affected()))?;
        found(affected, "token", id)?;
        Ok(())
    }
}
