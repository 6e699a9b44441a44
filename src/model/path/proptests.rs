//! Property tests for the path normaliser: every request path a client sends is run through
//! it before routing, so it must give one stable answer for every spelling of a path.
//!
//! The seed is fixed and failures are not persisted: see `config` in
//! `proxy/h1client/proptests.rs`, whose reasons hold here too.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

use super::*;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x5241_4148_4933_3132),
        ..ProptestConfig::default()
    }
}

/// A path segment as clients write them, hostile ones included: dot segments, escapes of any
/// case (well formed or not), escaped dots and slashes, empty segments.
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-zA-Z0-9_~-]{1,6}",
        2 => Just(".".to_owned()),
        2 => Just("..".to_owned()),
        1 => Just("...".to_owned()),
        1 => Just(String::new()),
        2 => "(%2[eE]|\\.){1,2}",
        2 => "[a-z]{0,2}%[0-9a-fA-F]{2}[a-z]{0,2}",
        1 => "[a-z]{0,2}%(2[fF]|5[cC])[a-z]{0,2}",
        1 => "[a-z]{0,2}%[0-9a-zA-Z]{0,2}",
    ]
}

fn raw_path() -> impl Strategy<Value = String> {
    vec(segment(), 0..8).prop_map(|segments| format!("/{}", segments.join("/")))
}

/// A path of unreserved characters and slashes, dot segments included.
fn plain_path() -> impl Strategy<Value = String> {
    let plain_segment = prop_oneof![
        4 => "[a-zA-Z0-9_~.-]{1,6}",
        1 => Just(".".to_owned()),
        1 => Just("..".to_owned()),
        1 => Just(String::new()),
    ];
    vec(plain_segment, 0..8).prop_map(|segments| format!("/{}", segments.join("/")))
}

/// `path` with the characters `chosen` picks (all unreserved or '/') escaped, in either case;
/// slashes are never escaped, as that changes the path's meaning.
fn escape_some(path: &str, chosen: &[bool], lower: &[bool]) -> String {
    let mut escaped = String::new();
    for (i, c) in path.chars().enumerate() {
        if c != '/' && chosen.get(i).copied().unwrap_or(false) {
            let hex = format!("%{:02X}", u32::from(c));
            if lower.get(i).copied().unwrap_or(false) {
                escaped.push_str(&hex.to_ascii_lowercase());
            } else {
                escaped.push_str(&hex);
            }
        } else {
            escaped.push(c);
        }
    }
    escaped
}

fn has_dot_or_empty_segment(path: &str) -> bool {
    let inner = path.strip_prefix('/').unwrap_or(path);
    let inner = inner.strip_suffix('/').unwrap_or(inner);
    !inner.is_empty()
        && inner
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
}

proptest! {
    #![proptest_config(config(4096))]

    /// The normal form is normal: it starts with '/', holds no `//` or dot segment, escapes only
    /// what must stay escaped, in upper case, and normalising it again gives it back, borrowed.
    #[test]
    fn the_normal_form_is_stable(path in raw_path()) {
        let Ok(normal) = normalize(&path, EscapedSlashes::Keep) else {
            return Ok(());
        };
        prop_assert!(normal.starts_with('/'), "{path:?} → {normal:?}");
        prop_assert!(!normal.contains("//"), "{path:?} → {normal:?}");
        prop_assert!(!has_dot_or_empty_segment(&normal), "{path:?} → {normal:?}");
        for (at, _) in normal.match_indices('%') {
            let hex = &normal[at + 1..at + 3];
            prop_assert_eq!(hex.to_ascii_uppercase(), hex, "{:?} → {:?}", path, normal);
            let byte = u8::from_str_radix(hex, 16).unwrap();
            prop_assert!(!is_unreserved(byte), "{path:?} → {normal:?}");
        }
        let again = normalize(&normal, EscapedSlashes::Keep).unwrap();
        prop_assert!(matches!(again, Cow::Borrowed(_)), "{normal:?} is not seen as normal");
        prop_assert_eq!(again.as_ref(), normal.as_ref());
    }

    /// The fast path agrees with the slow one: a path it takes as normal is its own normal form.
    #[test]
    fn the_fast_path_only_passes_normal_paths(path in raw_path()) {
        for mode in [EscapedSlashes::Keep, EscapedSlashes::Reject] {
            if is_normal(path.as_bytes(), mode) {
                let slow = decode_unreserved(&path, mode).and_then(|d| remove_dot_segments(&d));
                prop_assert_eq!(slow.as_deref(), Ok(path.as_str()), "{:?}", mode);
            }
        }
    }

    /// Escaping unreserved characters (in either case) never changes the normal form, so it
    /// never changes which route a request takes or what its target sees.
    #[test]
    fn escaping_unreserved_characters_changes_nothing(
        path in plain_path(),
        chosen in vec(any::<bool>(), 64),
        lower in vec(any::<bool>(), 64),
    ) {
        let escaped = escape_some(&path, &chosen, &lower);
        for mode in [EscapedSlashes::Keep, EscapedSlashes::Reject] {
            prop_assert_eq!(
                normalize(&escaped, mode),
                normalize(&path, mode),
                "{:?} and {:?}", escaped, path
            );
        }
    }

    /// Rejecting escaped slashes changes nothing else: either the same normal form, or the
    /// refusal, and only for a path that has one.
    #[test]
    fn reject_only_refuses_escaped_slashes(path in raw_path()) {
        let kept = normalize(&path, EscapedSlashes::Keep);
        match normalize(&path, EscapedSlashes::Reject) {
            Err(PathError::EscapedSlash) => {
                let lower = path.to_ascii_lowercase();
                prop_assert!(lower.contains("%2f") || lower.contains("%5c"), "{path:?}");
            }
            rejected => prop_assert_eq!(rejected, kept, "{:?}", path),
        }
    }
}
