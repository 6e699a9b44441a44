//! Reading a JSON document into a spec type with errors that name the field, as an operator
//! wrote it (`timeouts.connect_ms`), not as serde reports it.

use serde::de::DeserializeOwned;

use super::ValidationError;

/// Deserialises `value` into `T`; a document that does not fit (wrong type, unknown or missing
/// field, out of range) names the field.
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ValidationError> {
    serde_path_to_error::deserialize(value).map_err(|error| {
        let path = error.path().to_string();
        let message = readable(&strip_position(&error.into_inner().to_string()));
        ValidationError {
            field: field_name(&path, &message),
            message,
        }
    })
}

/// serde_json appends " at line L column C", which says nothing to someone reading a field error.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(index) => message[..index].to_owned(),
        None => message.to_owned(),
    }
}

/// Rust type names mean nothing to an API user.
fn readable(message: &str) -> String {
    match message.find("expected struct ") {
        Some(index) => format!("{}expected a JSON object", &message[..index]),
        None => message.to_owned(),
    }
}

/// serde reports a missing field at its parent's path; name the field itself. (An unknown
/// field's path already ends with its name.)
fn field_name(path: &str, message: &str) -> String {
    let named = message
        .split('`')
        .nth(1)
        .filter(|_| message.starts_with("missing field"));
    match (path, named) {
        (".", Some(name)) => name.to_owned(),
        (".", None) => "body".to_owned(),
        (_, Some(name)) => format!("{path}.{name}"),
        _ => path.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        inner: Inner,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        port: u16,
    }

    fn field_of(value: serde_json::Value) -> ValidationError {
        from_value::<Outer>(value).expect_err("the document does not fit")
    }

    #[test]
    fn errors_name_the_field_an_operator_wrote() {
        let missing = field_of(serde_json::json!({"inner": {"port": 1}}));
        assert_eq!(missing.field, "name");
        let nested_missing = field_of(serde_json::json!({"name": "a", "inner": {}}));
        assert_eq!(nested_missing.field, "inner.port");
        let out_of_range = field_of(serde_json::json!({"name": "a", "inner": {"port": 70000}}));
        assert_eq!(out_of_range.field, "inner.port");
        assert!(
            !out_of_range.message.contains(" at line "),
            "{out_of_range}"
        );
        let unknown = field_of(serde_json::json!({"name": "a", "inner": {"port": 1}, "x": 1}));
        assert_eq!(unknown.field, "x");
        let not_object = field_of(serde_json::json!({"name": "a", "inner": 3}));
        assert_eq!(not_object.field, "inner");
        assert!(
            not_object.message.contains("expected a JSON object"),
            "{not_object}"
        );
    }
}
