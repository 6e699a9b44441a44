//! TLS certificates for the HTTPS listener. The private key is stored with its certificate but
//! only [`Store::all_certificates_with_keys`] (the control task) ever reads it back.

use chrono::{DateTime, Utc};

use super::rows::{string_list, time};
use super::{convert_all, json_text, now_ms, Page, Store, StoreError};
use crate::model::{Certificate, CertificateWithKey, Id};

/// A certificate after the admin API parsed it: the names it is served for and its expiry.
pub struct NewCertificate<'a> {
    pub snis: &'a [String],
    pub cert_pem: &'a str,
    pub key_pem: &'a str,
    pub not_after: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct CertificateRow {
    id: i64,
    snis: String,
    cert_pem: String,
    key_pem: String,
    not_after: i64,
    created_at: i64,
    updated_at: i64,
}

impl CertificateRow {
    fn into_parts(self) -> Result<CertificateWithKey, StoreError> {
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
        let rows = sqlx::query_as::<_, CertificateRow>(
            "SELECT * FROM certificates WHERE id > ? ORDER BY id LIMIT ?",
        )
        .bind(page.after_id())
        .bind(page.limit)
        .fetch_all(&self.pool)
        .await?;
        convert_all(rows)
    }

    pub async fn get_certificate(&self, id: Id) -> Result<Certificate, StoreError> {
        sqlx::query_as::<_, CertificateRow>("SELECT * FROM certificates WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound {
                kind: "certificate",
                id,
            })?
            .try_into()
    }

    /// Every certificate with its key, for the HTTPS listener's certificate set.
    pub async fn all_certificates_with_keys(&self) -> Result<Vec<CertificateWithKey>, StoreError> {
        sqlx::query_as::<_, CertificateRow>("SELECT * FROM certificates ORDER BY id")
            .fetch_all(&self.pool)
            .await?
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
        let mut transaction = self.pool.begin().await?;
        let result = sqlx::query(
            "INSERT INTO certificates (snis, cert_pem, key_pem, not_after, created_at, updated_at)
             VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(json_text(new.snis))
        .bind(new.cert_pem)
        .bind(new.key_pem)
        .bind(new.not_after.timestamp_millis())
        .bind(now)
        .bind(now)
        .execute(&mut *transaction)
        .await?;
        let id = result.last_insert_rowid();
        for sni in new.snis {
            sqlx::query("INSERT INTO certificate_snis (sni, certificate_id) VALUES (?, ?)")
                .bind(sni)
                .bind(id)
                .execute(&mut *transaction)
                .await
                .map_err(|error| match &error {
                    sqlx::Error::Database(db) if db.is_unique_violation() => {
                        StoreError::Conflict {
                            field: "snis",
                            message: format!("another certificate already serves {sni:?}"),
                        }
                    }
                    _ => StoreError::Database(error),
                })?;
        }
        transaction.commit().await?;
        self.get_certificate(id).await
    }

    pub async fn delete_certificate(&self, id: Id) -> Result<(), StoreError> {
        let result = sqlx::query("DELETE FROM certificates WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "certificate",
                id,
            });
        }
        Ok(())
    }
}

