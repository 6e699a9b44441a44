//! Request paths in one normal form, so that what a route matches is what its target serves:
//! `/api/../admin`, `/%61pi/x` and `//api/x` mean the same to most targets as `/admin`,
//! `/api/x` and `/api/x`, and routing on the raw bytes would send them past the route meant for
//! them. The proxy normalises each request path before routing and forwards the normal form;
//! route prefixes are normalised the same way when written.
//!
//! The normal form (RFC 3986 §6.2.2, plus merged slashes): escapes of unreserved characters
//! (ALPHA DIGIT `-` `.` `_` `~`) decoded, the hex of the other escapes in upper case, repeated
//! slashes merged into one, dot segments (`.`, `..`, escaped or not) removed. A `..` that would
//! climb above the root is an error, not clamped: only a broken or hostile client sends one.
//! `%2F` and `%5C` stay escaped (decoded, they would make new segments the client did not
//! send), or are refused. A path that does not start with `/` (`*`, an authority) is left as
//! it is.

use std::borrow::Cow;

/// What to do with an escaped slash or backslash (`%2F`, `%5C`) in a request path (and, when
/// refused, a raw backslash).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    /// Forward it escaped (upper-case hex), as part of its segment.
    #[default]
    Keep,
    /// Refuse the request.
    Reject,
}

/// Why a path has no normal form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the path {}", self.reason())]
pub enum PathError {
    AboveRoot,
    MalformedEscape,
    EscapedSlash,
}

impl PathError {
    /// What is wrong, to follow the name of the path ("the path ...", "path_prefix ...").
    pub fn reason(self) -> &'static str {
        match self {
            PathError::AboveRoot => "climbs above the root with '..'",
            PathError::MalformedEscape => "has a '%' not followed by two hexadecimal digits",
            PathError::EscapedSlash => {
                "has a backslash or an escaped slash (%2F or %5C), which is refused here"
            }
        }
    }
}

/// The normal form of `path`: borrowed when `path` already is normal (the common request, at
/// the cost of one scan and no allocation), else owned.
pub fn normalize(path: &str, escaped_slashes: EscapedSlashes) -> Result<Cow<'_, str>, PathError> {
    // A raw backslash is a slash to the same targets that decode `%5C` (IIS, some
    // frameworks): where escaped ones are refused, so is it.
    if escaped_slashes == EscapedSlashes::Reject && path.as_bytes().contains(&b'\\') {
        return Err(PathError::EscapedSlash);
    }
    if !path.starts_with('/') || is_normal(path.as_bytes(), escaped_slashes) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path, escaped_slashes)?;
    remove_dot_segments(&decoded).map(Cow::Owned)
}

/// True when `path` (starting with `/`) needs no change: every escape is upper-case hex of a
/// character that stays escaped, and there is no empty or dot segment before the last.
fn is_normal(path: &[u8], escaped_slashes: EscapedSlashes) -> bool {
    let mut i = 0;
    while i < path.len() {
        match path[i] {
            b'%' => {
                let (Some(&high), Some(&low)) = (path.get(i + 1), path.get(i + 2)) else {
                    return false;
                };
                if !is_upper_hex(high) || !is_upper_hex(low) {
                    return false;
                }
                let byte = (hex_value(high).unwrap_or(0) << 4) | hex_value(low).unwrap_or(0);
                if is_unreserved(byte)
                    || (escaped_slashes == EscapedSlashes::Reject && is_slash(byte))
                {
                    return false;
                }
                i += 3;
            }
            b'/' => {
                let segment_end = |at: usize| path.get(at).is_none_or(|&b| b == b'/');
                match path.get(i + 1) {
                    Some(b'/') => return false,
                    Some(b'.') if segment_end(i + 2) => return false,
                    Some(b'.') if path.get(i + 2) == Some(&b'.') && segment_end(i + 3) => {
                        return false
                    }
                    _ => {}
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    true
}

/// `path` with escapes of unreserved characters decoded and the others in upper-case hex.
fn decode_unreserved(path: &str, escaped_slashes: EscapedSlashes) -> Result<String, PathError> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut decoded = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('%') {
        decoded.push_str(&rest[..at]);
        let escape = &rest.as_bytes()[at..];
        let (Some(high), Some(low)) = (
            escape.get(1).copied().and_then(hex_value),
            escape.get(2).copied().and_then(hex_value),
        ) else {
            return Err(PathError::MalformedEscape);
        };
        let byte = (high << 4) | low;
        if is_unreserved(byte) {
            decoded.push(char::from(byte));
        } else if escaped_slashes == EscapedSlashes::Reject && is_slash(byte) {
            return Err(PathError::EscapedSlash);
        } else {
            decoded.push('%');
            decoded.push(char::from(HEX[usize::from(high)]));
            decoded.push(char::from(HEX[usize::from(low)]));
        }
        // The two digits are ASCII: the escape ends on a character boundary.
        rest = &rest[at + 3..];
    }
    decoded.push_str(rest);
    Ok(decoded)
}

/// `path` (starting with `/`) with repeated slashes merged and dot segments removed (RFC 3986
/// §5.2.4, except that climbing above the root is an error). A path ending in an empty or dot
/// segment keeps its trailing slash: `/a/b/..` is `/a/`.
fn remove_dot_segments(path: &str) -> Result<String, PathError> {
    let mut normal = String::with_capacity(path.len());
    let mut ends_in_slash = false;
    for segment in path[1..].split('/') {
        ends_in_slash = true;
        match segment {
            "" | "." => {}
            ".." => {
                if normal.is_empty() {
                    return Err(PathError::AboveRoot);
                }
                let parent = normal.rfind('/').unwrap_or(0);
                normal.truncate(parent);
            }
            _ => {
                normal.push('/');
                normal.push_str(segment);
                ends_in_slash = false;
            }
        }
    }
    if ends_in_slash || normal.is_empty() {
        normal.push('/');
    }
    Ok(normal)
}

/// RFC 3986 §2.3.
fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

fn is_slash(byte: u8) -> bool {
    matches!(byte, b'/' | b'\\')
}

fn is_upper_hex(byte: u8) -> bool {
    matches!(byte, b'0'..=b'9' | b'A'..=b'F')
}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use EscapedSlashes::{Keep, Reject};

    /// (raw path, its normal form or the error) with escaped slashes kept.
    const CASES: &[(&str, Result<&str, PathError>)] = &[
        // Already normal.
        ("/", Ok("/")),
        ("/api/x", Ok("/api/x")),
        ("/api/x/", Ok("/api/x/")),
        ("/a%20b", Ok("/a%20b")),
        ("/.well-known/x", Ok("/.well-known/x")),
        ("/a/...", Ok("/a/...")),
        ("/a/.../b", Ok("/a/.../b")),
        ("/a/..b/.c", Ok("/a/..b/.c")),
        ("/api/a%2Fb", Ok("/api/a%2Fb")),
        // The examples.
        ("/api/../admin", Ok("/admin")),
        ("/api/%2e%2e/admin", Ok("/admin")),
        ("//api/x", Ok("/api/x")),
        ("/%61pi/x", Ok("/api/x")),
        ("/./api/x", Ok("/api/x")),
        // Escapes: unreserved decoded, the rest in upper case.
        ("/%7e", Ok("/~")),
        ("/%7Euser", Ok("/~user")),
        ("/%41", Ok("/A")),
        ("/%2d%2E%5f%30", Ok("/-._0")),
        ("/a%2fb", Ok("/a%2Fb")),
        ("/a%5cb", Ok("/a%5Cb")),
        ("/a%3fb", Ok("/a%3Fb")),
        ("/a%c3%a9", Ok("/a%C3%A9")),
        ("/%25", Ok("/%25")),
        ("/%2541", Ok("/%2541")),
        // Dot segments, plain or escaped.
        ("/a/%2e%2E/b", Ok("/b")),
        ("/a/.%2e/b", Ok("/b")),
        ("/a/%2e/b", Ok("/a/b")),
        ("/a/b/..", Ok("/a/")),
        ("/a/.", Ok("/a/")),
        ("/a/..", Ok("/")),
        ("/.", Ok("/")),
        ("/a/b/../../c/./d", Ok("/c/d")),
        // Repeated slashes, merged before dot segments go.
        ("///", Ok("/")),
        ("/a//b", Ok("/a/b")),
        ("/a//", Ok("/a/")),
        ("/a//../b", Ok("/b")),
        // Climbing above the root.
        ("/..", Err(PathError::AboveRoot)),
        ("/../x", Err(PathError::AboveRoot)),
        ("/a/../../b", Err(PathError::AboveRoot)),
        ("/a/%2e%2e/%2e%2e/..", Err(PathError::AboveRoot)),
        ("/%2E%2E", Err(PathError::AboveRoot)),
        // Malformed escapes.
        ("/a%", Err(PathError::MalformedEscape)),
        ("/a%4", Err(PathError::MalformedEscape)),
        ("/a%zz", Err(PathError::MalformedEscape)),
        ("/a%g1/b", Err(PathError::MalformedEscape)),
        ("/a%%41", Err(PathError::MalformedEscape)),
        ("/é%", Err(PathError::MalformedEscape)),
        // Not a path to normalise.
        ("*", Ok("*")),
        ("", Ok("")),
    ];

    #[test]
    fn each_case_has_its_normal_form() {
        for (raw, expected) in CASES {
            let got = normalize(raw, Keep);
            assert_eq!(got.as_deref().map_err(|e| *e), *expected, "{raw:?}");
        }
    }

    #[test]
    fn a_normal_path_is_borrowed() {
        for (raw, expected) in CASES {
            if let Ok(normal) = expected {
                let again = normalize(normal, Keep).unwrap();
                assert!(matches!(again, Cow::Borrowed(_)), "{normal:?} from {raw:?}");
            }
        }
    }

    #[test]
    fn reject_refuses_escaped_slashes_in_any_case() {
        for raw in ["/a%2Fb", "/a%2fb", "/a%5Cb", "/a%5cb", "/%2F"] {
            assert_eq!(
                normalize(raw, Reject),
                Err(PathError::EscapedSlash),
                "{raw}"
            );
            assert!(normalize(raw, Keep).is_ok(), "{raw}");
        }
        assert_eq!(normalize("/a%20b", Reject).unwrap(), "/a%20b");
        assert_eq!(normalize("/a\\b", Reject), Err(PathError::EscapedSlash));
        assert_eq!(normalize("/a/..\\b", Keep).unwrap(), "/a/..\\b");
        assert_eq!(normalize("/%61pi", Reject).unwrap(), "/api");
    }

    #[test]
    fn non_ascii_bytes_pass_through() {
        assert_eq!(normalize("/é/./ü", Keep).unwrap(), "/é/ü");
        assert!(matches!(normalize("/é", Keep).unwrap(), Cow::Borrowed(_)));
    }
}

#[cfg(test)]
mod proptests;
