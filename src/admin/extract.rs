//! Request extractors that turn every kind of bad input into an [`ApiError`] naming the field.

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use crate::model::Id;
use crate::store::Page;

/// Largest admin request body accepted.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
const DEFAULT_PAGE: u32 = 100;
const MAX_PAGE: u32 = 1000;

/// A JSON body deserialised into `T`: malformed JSON is a 400, a well-formed document that does
/// not fit `T` (wrong type, unknown or missing field, out of range) a 422 naming the field.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, _state: &S) -> Result<Self, ApiError> {
        let bytes = read_body(request.into_body()).await?;
        object_from_slice(&bytes).map(ApiJson)
    }
}

async fn read_body(body: Body) -> Result<bytes::Bytes, ApiError> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| ApiError::PayloadTooLarge {
            limit: MAX_BODY_BYTES,
        })
}

pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::Malformed {
            message: "request body is empty; expected a JSON object".to_owned(),
        });
    }
    let document: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|error| ApiError::Malformed {
            message: format!("invalid JSON: {error}"),
        })?;
    from_value(document)
}

/// An object body: serde would otherwise fill a struct's fields from a JSON array in order.
pub fn object_from_slice<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let document: serde_json::Value = parse_json(bytes)?;
    if !document.is_object() {
        return Err(ApiError::validation(
            "body",
            "the request body must be a JSON object",
        ));
    }
    from_value(document)
}

/// Deserialises an already parsed document (a merged PATCH) into `T`.
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    crate::validate::from_value(value).map_err(ApiError::from)
}

/// A JSON object for PATCH (RFC 7396 merge patch).
pub struct MergePatch(pub serde_json::Map<String, serde_json::Value>);

impl<S: Send + Sync> FromRequest<S> for MergePatch {
    type Rejection = ApiError;

    async fn from_request(request: Request, _state: &S) -> Result<Self, ApiError> {
        let bytes = read_body(request.into_body()).await?;
        match parse_json::<serde_json::Value>(&bytes)? {
            serde_json::Value::Object(map) => Ok(MergePatch(map)),
            _ => Err(ApiError::validation(
                "body",
                "a PATCH body must be a JSON object",
            )),
        }
    }
}

impl MergePatch {
    /// Applies the patch to `current` and reads the result back as `T`.
    pub fn apply<T: Serialize + DeserializeOwned>(self, current: &T) -> Result<T, ApiError> {
        self.apply_replacing(current, &[])
    }

    /// [`MergePatch::apply`], except that each of `whole` the patch gives a value replaces the
    /// current one instead of merging into it: a field that is one of several single-key
    /// objects (`hash_on`: `{"header"}` or `{"cookie"}`...) can only be swapped whole.
    pub fn apply_replacing<T: Serialize + DeserializeOwned>(
        self,
        current: &T,
        whole: &[&str],
    ) -> Result<T, ApiError> {
        let mut document = serde_json::to_value(current).map_err(|e| ApiError::Unavailable {
            message: format!("cannot serialise the current object: {e}"),
        })?;
        if let serde_json::Value::Object(fields) = &mut document {
            for &field in whole.iter().filter(|&&field| self.names_value_for(field)) {
                fields.insert(field.to_owned(), serde_json::Value::Null);
            }
        }
        // The crate's RFC 7396 merge rather than our own: a nested object patched onto a
        // member that is null or absent must still have its nulls removed, not copied in.
        json_patch::merge(&mut document, &serde_json::Value::Object(self.0));
        from_value(document)
    }

    /// The patch names `field`, as a value or as null.
    pub fn names(&self, field: &str) -> bool {
        self.0.contains_key(field)
    }

    /// The patch gives `field` a value (not null).
    pub fn names_value_for(&self, field: &str) -> bool {
        self.0.get(field).is_some_and(|value| !value.is_null())
    }
}

/// An `{id}` path segment.
pub struct IdPath(pub Id);

impl<S: Send + Sync> FromRequestParts<S> for IdPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::Malformed {
                message: e.body_text(),
            })?;
        match raw.parse::<Id>() {
            Ok(id) if id > 0 => Ok(IdPath(id)),
            _ => Err(ApiError::NotFound {
                message: format!("{raw:?} is not a valid id"),
            }),
        }
    }
}

/// `?limit=` (1..=1000, default 100) and `?after=` (an id).
/// Describes the query for the OpenAPI document; [`Pagination`] parses it with field-named errors.
#[derive(Debug, Clone, Copy, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct PageQuery {
    /// Objects per page, 1 to 1000 (default 100).
    pub limit: Option<u32>,
    /// Return objects whose id is greater than this cursor (the previous page's `next`).
    pub after: Option<Id>,
}

pub struct Pagination(pub Page);

impl<S: Send + Sync> FromRequestParts<S> for Pagination {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let query = parts.uri.query().unwrap_or("");
        let mut page = Page {
            limit: DEFAULT_PAGE,
            after: None,
        };
        for (key, value) in form_urlencoded_pairs(query) {
            match key.as_str() {
                "limit" => match value.parse::<u32>() {
                    Ok(limit) if (1..=MAX_PAGE).contains(&limit) => page.limit = limit,
                    _ => {
                        return Err(ApiError::validation(
                            "limit",
                            format!("limit must be an integer from 1 to {MAX_PAGE}"),
                        ))
                    }
                },
                "after" => match value.parse::<Id>() {
                    Ok(after) if after >= 0 => page.after = Some(after),
                    _ => {
                        return Err(ApiError::validation(
                            "after",
                            "after must be an id from a previous page's `next`",
                        ))
                    }
                },
                _ => {}
            }
        }
        Ok(Pagination(page))
    }
}

fn form_urlencoded_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (key.to_owned(), value.to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TargetSpec;

    fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
        object_from_slice(bytes)
    }

    #[test]
    fn an_array_is_not_an_object() {
        let error = parse_json::<TargetSpec>(br#"["127.0.0.1", 80]"#).unwrap_err();
        assert!(matches!(error, ApiError::Validation { ref field, .. } if field == "body"));
    }

    #[test]
    fn malformed_json_is_a_400() {
        let error = parse_json::<TargetSpec>(b"{\"host\": ").unwrap_err();
        assert!(matches!(error, ApiError::Malformed { .. }), "{error:?}");
    }

    #[test]
    fn wrong_type_names_the_field() {
        let error =
            parse_json::<TargetSpec>(br#"{"host": "127.0.0.1", "port": "eighty"}"#).unwrap_err();
        match error {
            ApiError::Validation { field, .. } => assert_eq!(field, "port"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn out_of_range_port_names_the_field() {
        let error =
            parse_json::<TargetSpec>(br#"{"host": "127.0.0.1", "port": 70000}"#).unwrap_err();
        match error {
            ApiError::Validation { field, message } => {
                assert_eq!(field, "port");
                assert!(message.contains("70000"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_and_missing_fields_are_named() {
        let unknown =
            parse_json::<TargetSpec>(br#"{"host": "h", "port": 1, "colour": 1}"#).unwrap_err();
        assert!(matches!(unknown, ApiError::Validation { ref field, .. } if field == "colour"));
        let missing = parse_json::<TargetSpec>(br#"{"host": "h"}"#).unwrap_err();
        assert!(matches!(missing, ApiError::Validation { ref field, .. } if field == "port"));
    }

    /// Applies `patch` the way every PATCH handler does, through [`MergePatch::apply`].
    fn merged(document: serde_json::Value, patch: serde_json::Value) -> serde_json::Value {
        let serde_json::Value::Object(patch) = patch else {
            panic!("a PATCH body is an object: {patch}");
        };
        MergePatch(patch).apply(&document).expect("a JSON value")
    }

    #[test]
    fn merge_patch_replaces_and_removes() {
        let document = serde_json::json!({"a": 1, "b": {"c": 2, "d": 3}});
        let patch = serde_json::json!({"a": 5, "b": {"d": null}});
        assert_eq!(
            merged(document, patch),
            serde_json::json!({"a": 5, "b": {"c": 2}})
        );
    }

    #[test]
    fn nested_nulls_are_removed_where_the_current_member_is_null_or_absent() {
        let patch = serde_json::json!({"check": {"type": "http", "path": null}});
        let expected = serde_json::json!({"check": {"type": "http"}});
        assert_eq!(
            merged(serde_json::json!({"check": null}), patch.clone()),
            expected
        );
        assert_eq!(merged(serde_json::json!({}), patch.clone()), expected);
        assert_eq!(merged(serde_json::json!({"check": 7}), patch), expected);
    }

    /// RFC 7396 appendix A, the cases whose patch is an object (a PATCH body must be one).
    #[test]
    fn rfc_7396_appendix_a() {
        use serde_json::json;
        let cases = [
            (json!({"a": "b"}), json!({"a": "c"}), json!({"a": "c"})),
            (
                json!({"a": "b"}),
                json!({"b": "c"}),
                json!({"a": "b", "b": "c"}),
            ),
            (json!({"a": "b"}), json!({"a": null}), json!({})),
            (
                json!({"a": "b", "b": "c"}),
                json!({"a": null}),
                json!({"b": "c"}),
            ),
            (json!({"a": ["b"]}), json!({"a": "c"}), json!({"a": "c"})),
            (json!({"a": "c"}), json!({"a": ["b"]}), json!({"a": ["b"]})),
            (
                json!({"a": {"b": "c"}}),
                json!({"a": {"b": "d", "c": null}}),
                json!({"a": {"b": "d"}}),
            ),
            (
                json!({"a": [{"b": "c"}]}),
                json!({"a": [1]}),
                json!({"a": [1]}),
            ),
            (
                json!({"e": null}),
                json!({"a": 1}),
                json!({"e": null, "a": 1}),
            ),
            (
                json!([1, 2]),
                json!({"a": "b", "c": null}),
                json!({"a": "b"}),
            ),
            (
                json!({}),
                json!({"a": {"bb": {"ccc": null}}}),
                json!({"a": {"bb": {}}}),
            ),
        ];
        for (document, patch, expected) in cases {
            assert_eq!(
                merged(document.clone(), patch.clone()),
                expected,
                "{document} + {patch}"
            );
        }
    }
}
