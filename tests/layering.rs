//! The dependency arrows of DESIGN §3, checked: every path a module names inside the crate
//! (`use crate::…`, `crate::x::y` in code, `super::…`) must be one the design allows. A new
//! arrow is a design change: change DESIGN §3 and the table below together.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Which top-level modules each top-level module may name. A module may always name itself
/// and `clock` (the one home for "now"). `main.rs` and `lib.rs` are the crate's roots and are
/// not checked; `gateway` wires everything.
const ALLOWED: &[(&str, &[&str])] = &[
    ("model", &[]),
    ("config", &[]),
    ("telemetry", &[]),
    ("clock", &[]),
    ("balance", &["model"]),
    ("discovery", &["model"]),
    ("store", &["model"]),
    ("events", &["model"]),
    ("tls", &["model"]),
    ("status", &["model"]),
    ("snapshot", &["model", "balance"]),
    ("proxy", &["snapshot", "balance", "tls", "model"]),
    // What operators write is checked where the model and the providers live, for the admin
    // API and the resources file alike.
    ("validate", &["model", "discovery", "tls"]),
    ("registration", &["model", "config"]),
    (
        "control",
        &[
            "model",
            "balance",
            "discovery",
            "store",
            "snapshot",
            "events",
            "tls",
            "proxy",
        ],
    ),
    (
        "admin",
        &[
            "model",
            "store",
            "control",
            "events",
            "discovery",
            "validate",
            "registration",
            // Read-only: the data path's counters for `/metrics` and live target state.
            "snapshot",
        ],
    ),
    ("resources", &["model", "store", "control", "validate"]),
    (
        "gateway",
        &[
            "admin",
            "balance",
            "config",
            "control",
            "discovery",
            "events",
            "model",
            "proxy",
            "registration",
            "resources",
            "snapshot",
            "store",
            "tls",
        ],
    ),
];

/// Inside a layer, a lower piece never names a higher one: (module, what it must not name).
const FORBIDDEN_INSIDE: &[(&str, &str)] = &[
    // The HTTP/1.1 codec does not know its pool; the pool knows no protocol.
    ("proxy::h1client", "proxy::pool"),
    ("proxy::pool", "proxy::h1client"),
    ("proxy::pool", "proxy::forward"),
    ("proxy::h1client", "proxy::forward"),
    ("proxy::h1client", "proxy::client"),
    // L4 does not borrow from HTTP, nor HTTP from L4.
    ("proxy::stream", "proxy::forward"),
    ("proxy::stream", "proxy::h1server"),
    ("proxy::stream", "proxy::h1client"),
    ("proxy::stream", "proxy::body"),
    ("proxy::stream", "proxy::client"),
    ("proxy::stream", "proxy::headers"),
    ("proxy::forward", "proxy::stream"),
    ("proxy::h1server", "proxy::stream"),
    // The pure pieces stay pure.
    ("discovery::reconcile", "discovery::runner"),
    ("discovery::guard", "discovery::runner"),
    ("discovery::lifecycle", "discovery::runner"),
];

/// The discovery providers, and the registry in `discovery/mod.rs` that builds them: a provider
/// implements the contract there (`PollProvider`, `WatchProvider`, `Fetch`...) but never names
/// the factory.
const PROVIDERS: &[&str] = &[
    "discovery::dns",
    "discovery::dns_srv",
    "discovery::http",
    "discovery::consul",
    "discovery::kubernetes",
];
const PROVIDER_FACTORY: &[&str] = &[
    "discovery::build",
    "discovery::validate",
    "discovery::descriptors",
];

/// Every (module, what it must not name) pair.
fn forbidden_inside() -> Vec<(&'static str, &'static str)> {
    let mut pairs = FORBIDDEN_INSIDE.to_vec();
    for provider in PROVIDERS {
        for factory in PROVIDER_FACTORY {
            pairs.push((provider, factory));
        }
    }
    pairs
}

/// One reference from a source file to a module path inside the crate.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Reference {
    file: String,
    /// The referring module's path, e.g. `proxy::forward::retry`.
    from: Vec<String>,
    /// The path named, resolved to start at the crate root, e.g. `proxy::pool::TargetPool`.
    to: Vec<String>,
}

/// The module path of a source file: `src/proxy/forward/mod.rs` is `proxy::forward`.
fn module_path(relative: &Path) -> Vec<String> {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|part| part.to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if stem != "mod" {
            parts.push(stem.to_owned());
        }
    }
    parts
}

/// Code without comments and string literals, so a path in prose or in a message is not an
/// import. Char literals are left alone; a quote inside one (`'"'`) is handled.
fn code_only(source: &str) -> String {
    let bytes = source.as_bytes();
    let mut code = String::with_capacity(source.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < bytes.len() && !(bytes[i] == b'*' && bytes[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'\'' if bytes.get(i + 2) == Some(&b'\'') => {
                code.push_str("' '");
                i += 3;
            }
            b'\'' if bytes.get(i + 1) == Some(&b'\\') => {
                // An escaped char literal ('\'', '\n', '\u{…}'): skip to its closing quote.
                i += 3;
                while i < bytes.len() && bytes[i] != b'\'' {
                    i += 1;
                }
                i += 1;
                code.push_str("' '");
            }
            b'r' if matches!(bytes.get(i + 1), Some(b'"') | Some(b'#'))
                && (i == 0 || !is_ident_byte(bytes[i - 1])) =>
            {
                // A raw string: r"…" or r#"…"#.
                let mut hashes = 0;
                let mut j = i + 1;
                while bytes.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if bytes.get(j) != Some(&b'"') {
                    code.push('r');
                    i += 1;
                    continue;
                }
                let closing: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                j += 1;
                while j < bytes.len() && !bytes[j..].starts_with(&closing) {
                    j += 1;
                }
                i = j + closing.len();
                code.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                code.push_str("\"\"");
            }
            _ => {
                let start = i;
                i += 1;
                while i < bytes.len() && !matches!(bytes[i], b'/' | b'\'' | b'"' | b'r') {
                    i += 1;
                }
                code.push_str(&source[start..i]);
            }
        }
    }
    code
}

fn is_ident_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// Code that only tests compile (`#[cfg(test)] mod … { … }`) may use anything in the crate:
/// it is not part of the architecture. Removes those blocks.
fn without_test_modules(code: &str) -> String {
    let mut kept = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        kept.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let item = without_visibility(after.trim_start());
        let is_inline_mod = item.starts_with("mod ")
            && item
                .find(['{', ';'])
                .is_some_and(|end| item.as_bytes()[end] == b'{');
        if !is_inline_mod {
            kept.push_str("#[cfg(test)]");
            rest = after;
            continue;
        }
        let open = after.find('{').expect("an inline module has a body");
        let mut depth = 0usize;
        let mut end = after.len();
        for (index, byte) in after.bytes().enumerate().skip(open) {
            match byte {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = index + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    kept.push_str(rest);
    kept
}

/// `item` without a leading `pub`, `pub(crate)`, `pub(super)` or `pub(in …)`.
fn without_visibility(item: &str) -> &str {
    let Some(rest) = item.strip_prefix("pub") else {
        return item;
    };
    let rest = match rest.strip_prefix('(') {
        Some(inside) => inside.split_once(')').map_or(rest, |(_, after)| after),
        None => rest,
    };
    rest.trim_start()
}

/// The names of the modules a file declares for tests only (`#[cfg(test)] mod tests;`): their
/// files are skipped like inline test modules.
fn test_module_files(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        rest = &rest[at + "#[cfg(test)]".len()..];
        let item = without_visibility(rest.trim_start());
        if let Some(declared) = item.strip_prefix("mod ") {
            let name: String = declared
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if declared[name.len()..].trim_start().starts_with(';') {
                names.push(name);
            }
        }
    }
    names
}

/// Every path that follows `anchor` (`crate`, `super`, `self`) as `anchor::…`, with `use`
/// groups expanded: `crate::{a, b::{c, d}}` names `a`, `b::c` and `b::d`.
fn paths_after(code: &str, anchor: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let pattern = format!("{anchor}::");
    let mut search = 0;
    while let Some(offset) = code[search..].find(&pattern) {
        let at = search + offset;
        search = at + pattern.len();
        let preceded_by_ident = at > 0 && is_ident_byte(code.as_bytes()[at - 1]);
        let preceded_by_path = code[..at].trim_end().ends_with("::");
        if preceded_by_ident || preceded_by_path {
            continue;
        }
        let mut rest = &code[search..];
        found.extend(parse_tree(&mut rest, Vec::new()));
    }
    found
}

/// Parses a path or `use` tree at the start of `rest` (after an `::`), prefixed by `prefix`.
fn parse_tree(rest: &mut &str, prefix: Vec<String>) -> Vec<Vec<String>> {
    *rest = rest.trim_start();
    if let Some(inside) = rest.strip_prefix('{') {
        *rest = inside;
        let mut paths = Vec::new();
        loop {
            *rest = rest.trim_start();
            if let Some(after) = rest.strip_prefix('}') {
                *rest = after;
                return paths;
            }
            if let Some(after) = rest.strip_prefix(',') {
                *rest = after;
                continue;
            }
            let before = rest.len();
            paths.extend(parse_tree(rest, prefix.clone()));
            if rest.len() == before {
                // Not a path (a macro's odd input): stop rather than loop.
                return paths;
            }
        }
    }
    if let Some(after) = rest.strip_prefix('*') {
        *rest = after;
        return vec![prefix];
    }
    let length = rest.bytes().take_while(|byte| is_ident_byte(*byte)).count();
    if length == 0 {
        return if prefix.is_empty() {
            Vec::new()
        } else {
            vec![prefix]
        };
    }
    let mut path = prefix;
    path.push(rest[..length].to_owned());
    *rest = &rest[length..];
    let trimmed = rest.trim_start();
    if let Some(after) = trimmed.strip_prefix("::") {
        if !after.trim_start().starts_with('<') {
            *rest = after;
            return parse_tree(rest, path);
        }
    }
    vec![path]
}

/// The references one file makes, resolved to crate-root paths.
fn references_in(file: &str, module: &[String], source: &str) -> Vec<Reference> {
    let code = without_test_modules(&code_only(source));
    let mut references = Vec::new();
    let mut add = |to: Vec<String>| {
        if !to.is_empty() {
            references.push(Reference {
                file: file.to_owned(),
                from: module.to_vec(),
                to,
            });
        }
    };
    for path in paths_after(&code, "crate") {
        add(path);
    }
    // `super::` from module a::b::c names a::b::…; a file's own inline `mod tests` is one
    // level deeper, which this cannot tell, so `super::` resolves from the file's module:
    // at worst it names the file's own module, which is always allowed.
    for path in paths_after(&code, "super") {
        let mut resolved = module[..module.len().saturating_sub(1)].to_vec();
        let mut path = path.into_iter().peekable();
        while path.peek().is_some_and(|segment| segment == "super") {
            path.next();
            resolved.pop();
        }
        resolved.extend(path);
        add(resolved);
    }
    references
}

fn allowed_tops(top: &str) -> Option<&'static [&'static str]> {
    ALLOWED
        .iter()
        .find(|(module, _)| *module == top)
        .map(|(_, allowed)| *allowed)
}

fn starts_with(path: &[String], prefix: &str) -> bool {
    let prefix: Vec<&str> = prefix.split("::").collect();
    path.len() >= prefix.len() && path.iter().zip(&prefix).all(|(a, b)| a == b)
}

/// What a reference breaks, if anything.
fn violation(reference: &Reference, known_tops: &BTreeSet<String>) -> Option<String> {
    let from_top = reference.from.first()?;
    let to_top = reference.to.first()?;
    let shown = format!(
        "{} ({}) names crate::{}",
        reference.from.join("::"),
        reference.file,
        reference.to.join("::")
    );
    if from_top != to_top && to_top != "clock" && known_tops.contains(to_top) {
        let Some(allowed) = allowed_tops(from_top) else {
            return Some(format!(
                "{shown}, but module `{from_top}` has no row in the layering table"
            ));
        };
        if !allowed.contains(&to_top.as_str()) {
            return Some(format!(
                "{shown}: `{from_top}` may not import `{to_top}` (DESIGN §3)"
            ));
        }
    }
    for (module, forbidden) in forbidden_inside() {
        if starts_with(&reference.from, module) && starts_with(&reference.to, forbidden) {
            return Some(format!(
                "{shown}: `{module}` must not name `{forbidden}` (DESIGN §3)"
            ));
        }
    }
    None
}

fn source_files(dir: &Path, files: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            source_files(&path, files);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
}

/// Every reference in `src/`, and the set of top-level modules.
fn crate_references() -> (Vec<Reference>, BTreeSet<String>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    source_files(&src, &mut files);
    let mut parsed = Vec::new();
    let mut test_only: BTreeSet<Vec<String>> = BTreeSet::new();
    for path in &files {
        let relative = path.strip_prefix(&src).expect("under src").to_path_buf();
        let module = module_path(&relative);
        let source = std::fs::read_to_string(path).expect("a readable source file");
        for name in test_module_files(&code_only(&source)) {
            let mut child = module.clone();
            child.push(name);
            test_only.insert(child);
        }
        parsed.push((relative, module, source));
    }
    let mut references = Vec::new();
    let mut tops = BTreeSet::new();
    for (relative, module, source) in parsed {
        let Some(top) = module.first() else { continue };
        if top == "main" || top == "lib" {
            continue;
        }
        tops.insert(top.clone());
        let in_test_module = (1..=module.len()).any(|len| test_only.contains(&module[..len]));
        if in_test_module {
            continue;
        }
        references.extend(references_in(
            &relative.display().to_string(),
            &module,
            &source,
        ));
    }
    (references, tops)
}

#[test]
fn every_import_follows_the_arrows_of_design_section_3() {
    let (references, tops) = crate_references();
    assert!(
        references.len() > 200,
        "the scan found only {} references: it is broken",
        references.len()
    );
    for top in &tops {
        assert!(
            allowed_tops(top).is_some(),
            "module `{top}` is not in the layering table: add its row (and to DESIGN §3)"
        );
    }
    let violations: BTreeSet<String> = references
        .iter()
        .filter_map(|reference| violation(reference, &tops))
        .collect();
    assert!(
        violations.is_empty(),
        "imports against DESIGN §3:\n{}",
        violations.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn a_broken_arrow_is_found() {
    let tops: BTreeSet<String> = ["proxy", "store", "model", "snapshot", "clock"]
        .into_iter()
        .map(String::from)
        .collect();
    let module = |path: &str| module_path(Path::new(path));
    let source = r#"
        //! Mentions crate::store in prose, which is fine.
        use crate::{model::Id, snapshot::{RouteEntry, ServiceRuntime}};
        use super::pool::TargetPool;
        fn f() { let _ = crate::store::Store::open("crate::store"); let _ = crate::clock::unix_ms(); }
    "#;
    let references = references_in("proxy/h1client.rs", &module("proxy/h1client.rs"), source);
    let targets: Vec<String> = references
        .iter()
        .map(|reference| reference.to.join("::"))
        .collect();
    assert_eq!(
        targets,
        [
            "model::Id",
            "snapshot::RouteEntry",
            "snapshot::ServiceRuntime",
            "store::Store::open",
            "clock::unix_ms",
            "proxy::pool::TargetPool",
        ]
    );
    let violations: Vec<String> = references
        .iter()
        .filter_map(|reference| violation(reference, &tops))
        .collect();
    assert_eq!(violations.len(), 2, "{violations:#?}");
    assert!(violations[0].contains("`proxy` may not import `store`"));
    assert!(violations[1].contains("`proxy::h1client` must not name `proxy::pool`"));

    let tops: BTreeSet<String> = ["discovery", "model"]
        .into_iter()
        .map(String::from)
        .collect();
    let provider = references_in(
        "discovery/dns.rs",
        &module("discovery/dns.rs"),
        "use crate::discovery::{build, ConfigError, PollProvider};",
    );
    let violations: Vec<String> = provider
        .iter()
        .filter_map(|reference| violation(reference, &tops))
        .collect();
    assert_eq!(violations.len(), 1, "{violations:#?}");
    assert!(violations[0].contains("`discovery::dns` must not name `discovery::build`"));
}

#[test]
fn test_only_code_is_not_part_of_the_architecture() {
    let source = "use crate::model::Id;\n#[cfg(test)]\npub(super) mod tests {\n    use crate::store::Store;\n    fn f() { if true { } }\n}\n#[cfg(test)]\nmod proptests;\nuse crate::snapshot::X;";
    let module = module_path(Path::new("proxy/pool.rs"));
    let references = references_in("proxy/pool.rs", &module, source);
    let targets: Vec<String> = references
        .iter()
        .map(|reference| reference.to.join("::"))
        .collect();
    assert_eq!(targets, ["model::Id", "snapshot::X"]);
    assert_eq!(test_module_files(source), ["proptests"]);
}

#[test]
fn super_paths_resolve_from_the_files_module() {
    let module = module_path(Path::new("proxy/forward/retry.rs"));
    assert_eq!(module, ["proxy", "forward", "retry"]);
    let references = references_in(
        "proxy/forward/retry.rs",
        &module,
        "use super::super::stream::X; use super::rewrite::Y;",
    );
    let targets: Vec<String> = references
        .iter()
        .map(|reference| reference.to.join("::"))
        .collect();
    assert_eq!(targets, ["proxy::stream::X", "proxy::forward::rewrite::Y"]);
    assert_eq!(
        module_path(Path::new("proxy/forward/mod.rs")),
        ["proxy", "forward"]
    );
}
