//! TLS certificates for the HTTPS listener. The private key is stored with its certificate but
//! only [`Store::all_certificates_with_keys`] (the control task) ever reads it back.

use chrono::{DateTime, Utc};

use super::rows::{string_list, time};
use super::{convert_all, found, json_text, now_ms, Page, Store, StoreError};
use crate::model::{Certificate, CertificateWithKey, Id};

/// A certificate after the admin API parsed it: the names it is served for and its expiry.
pub struct NewCertificate<'a> {
    pub snis: &'a [String],
    pub cert_pem: &'a str,
    pub key_pem: &'a str,
    pub not_after: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
pub(super) struct CertificateRow {
    id: i64,
    snis: String,
    cert_pem: String,
    key_pem: String,
    not_after: i64,
    created_at: i64,
    updated_at: i64,
}

/// A stored certificate with its key, as the routing snapshot needs it.
impl TryFrom<CertificateRow> for CertificateWithKey {
    type Error = StoreError;
    fn try_from(row: CertificateRow) -> Result<Self, StoreError> {
        row.into_parts()
    }
}

impl CertificateRow {
    pub(super) fn into_parts(self) -> Result<CertificateWithKey, StoreError> {
        Ok(CertificateWithKey {
            certificate: Certificate {
                id: self.id,
                snis: string_list(&self.snis, "certificate snis")?,
                cert_pem: self.cert_pem,
                not_after: time(self.not_after)?,
                created_at: time(self.created_at)?,
                updated_at: time(self.updated_at)?,
            },
            key_pem: self.key_pem,
        })
    }
}

impl TryFrom<CertificateRow> for Certificate {
    type Error = StoreError;
    fn try_from(row: CertificateRow) -> Result<Self, StoreError> {
        Ok(row.into_parts()?.certificate)
    }
}

impl Store {
    pub async fn list_certificates(&self, page: Page) -> Result<Vec<Certificate>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, CertificateRow>(
            "SELECT * FROM certificates WHERE id > $1 ORDER BY id LIMIT $2",
        )
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    pub async fn get_certificate(&self, id: Id) -> Result<Certificate, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, CertificateRow>(
            "SELECT * FROM certificates WHERE id = $1"
        )
        .bind(id)
        .fetch_optional(pool)
        .await)?
        .ok_or(StoreError::NotFound {
            kind: "certificate",
            id,
        })?
        .try_into()
    }

    /// Every certificate with its key, for the HTTPS listener's certificate set.
    pub async fn all_certificates_with_keys(&self) -> Result<Vec<CertificateWithKey>, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, CertificateRow>(
            "SELECT * FROM certificates ORDER BY id"
        )
        .fetch_all(pool)
        .await)?
        .into_iter()
        .map(CertificateRow::into_parts)
        .collect()
    }

    /// Stores a certificate; a name another certificate already serves is a conflict on `snis`.
    pub async fn create_certificate(
        &self,
        new: &NewCertificate<'_>,
    ) -> Result<Certificate, StoreError> {
        let now = now_ms();
        let id = on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let id = sqlx::query_scalar::<_, i64>(
                "INSERT INTO certificates (snis, cert_pem, key_pem, not_after, created_at, updated_at)
                 VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
            )
            .bind(json_text(new.snis))
            .bind(new.cert_pem)
            .bind(new.key_pem)
            .bind(new.not_after.timestamp_millis())
            .bind(now)
            .bind(now)
            .fetch_one(&mut *transaction)
            .await?;
            for sni in new.snis {
                sqlx::query("INSERT INTO certificate_snis (sni, certificate_id) VALUES ($1, $2)")
                    .bind(sni)
                    .bind(id)
                    .execute(&mut *transaction)
                    .await
                    .map_err(|error| sni_conflict(error, sni))?;
            }
            transaction.commit().await?;
            id
        });
        self.get_certificate(id).await
    }

    /// Replaces a certificate, its key and its names in one transaction, so a renewal never
    /// leaves a moment in which its names are served by nothing (or by the default).
    pub async fn update_certificate(
        &self,
        id: Id,
        new: &NewCertificate<'_>,
    ) -> Result<Certificate, StoreError> {
        let now = now_ms();
        let updated = on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let updated = sqlx::query(
                "UPDATE certificates SET snis = $1, cert_pem = $2, key_pem = $3, not_after = $4,
                    updated_at = $5
                 WHERE id = $6",
            )
            .bind(json_text(new.snis))
            .bind(new.cert_pem)
            .bind(new.key_pem)
            .bind(new.not_after.timestamp_millis())
            .bind(now)
            .bind(id)
            .execute(&mut *transaction)
            .await?
            .rows_affected();
            if updated > 0 {
                sqlx::query("DELETE FROM certificate_snis WHERE certificate_id = $1")
                    .bind(id)
                    .execute(&mut *transaction)
                    .await?;
                for sni in new.snis {
                    sqlx::query(
                        "INSERT INTO certificate_snis (sni, certificate_id) VALUES ($1, $2)",
                    )
                    .bind(sni)
                    .bind(id)
                    .execute(&mut *transaction)
                    .await
                    .map_err(|error| sni_conflict(error, sni))?;
                }
            }
            transaction.commit().await?;
            updated
        });
        found(updated, "certificate", id)?;
        self.get_certificate(id).await
    }

    pub async fn delete_certificate(&self, id: Id) -> Result<(), StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query(
            "DELETE FROM certificates WHERE id = $1"
        )
        .bind(id)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))?;
        found(affected, "certificate", id)?;
        Ok(())
    }
}

/// A name another certificate already serves is the operator's conflict, not a store failure.
fn sni_conflict(error: sqlx::Error, sni: &str) -> StoreError {
    match &error {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict {
            field: "snis",
            message: format!("another certificate already serves {sni:?}"),
        },
        _ => StoreError::Database(error),
    }
}
