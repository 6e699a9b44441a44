//! The dependency arrows of DESIGN §3, checked: every path a module names inside the crate
//! (`use crate::…`, `crate::x::y` in code, `super::…`) must be one the design allows. A new
//! arrow is a design change: change DESIGN §3 and the table below together.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Which top-level modules each top-level module may name. A module may always name itself
/// and the [`EVERYWHERE`] ones. `main.rs` and `lib.rs` are the crate's roots and are
/// not checked; `gateway` wires everything.
const ALLOWED: &[(&str, &[&str])] = &[
    ("clock", &[]),
    ("error_chain", &[]),
    ("model", &[]),
    ("config", &[]),
    ("telemetry", &[]),
    ("balance", &["model"]),
    ("discovery", &["model"]),
    ("store", &["model"]),
    ("events", &["model"]),
    ("tls", &["model"]),
    ("status", &["model"]),
    ("snapshot", &["model", "balance"]),
    // `telemetry`: access lines, which the request path writes without tracing.
    (
        "proxy",
        &["snapshot", "balance", "tls", "model", "telemetry"],
    ),
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
            // Read-only: the dropped log lines for `/metrics`.
            "telemetry",
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
            // Starts the span exporter from `[tracing]` and flushes it on shutdown.
            "telemetry",
            "tls",
        ],
    ),
];

/// The modules any module may name: `clock`, the one home for "now", and `error_chain`, the
/// one walk of an error's causes. Both name nothing of the crate.
const EVERYWHERE: &[&str] = &["clock", "error_chain"];

/// Items that `lib.rs` itself defines (not modules), which any module may name.
const ROOT_ITEMS: &[&str] = &[];

/// Inside a layer, a lower piece never names a higher one: (module, what it must not name).
const FORBIDDEN_INSIDE: &[(&str, &str)] = &[
    // The HTTP/1.1 codec does not know its pool; the pool knows no protocol.
    ("proxy::h1client", "proxy::pool"),
    ("proxy::pool", "proxy::h1client"),
    ("proxy::pool", "proxy::forward"),
    ("proxy::pool", "proxy::plain_target"),
    ("proxy::h1client", "proxy::plain_target"),
    // The pieces HTTP and L4 share stay below both.
    ("proxy::failure", "proxy::forward"),
    ("proxy::failure", "proxy::stream"),
    ("proxy::failure", "proxy::error"),
    ("proxy::accounting", "proxy::forward"),
    ("proxy::accounting", "proxy::stream"),
    ("proxy::accounting", "proxy::error"),
    ("proxy::stream", "proxy::error"),
    ("proxy::h1client", "proxy::forward"),
    ("proxy::h1client", "proxy::client"),
    // The request bodies sit below the upstream codecs that send them; the response side,
    // which wraps what the codecs read, is `response_body`.
    ("proxy::body", "proxy::h1client"),
    ("proxy::body", "proxy::h2client"),
    ("proxy::body", "proxy::response_body"),
    // A relay copies bytes and says how it ended; the connection that runs it is above it.
    ("proxy::stream::relay", "proxy::stream::connection"),
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
fn paths_after(code: &str, anchor: &str) -> Vec<Parsed> {
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

/// A path as written, and the name a `use` binds it to when it says `as name`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Parsed {
    path: Vec<String>,
    alias: Option<String>,
}

/// Parses a path or `use` tree at the start of `rest` (after an `::`), prefixed by `prefix`. A
/// glob ends its path with `*`.
fn parse_tree(rest: &mut &str, prefix: Vec<String>) -> Vec<Parsed> {
    let plain = |path: Vec<String>| Parsed { path, alias: None };
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
        let mut glob = prefix;
        glob.push("*".to_owned());
        return vec![plain(glob)];
    }
    let length = rest.bytes().take_while(|byte| is_ident_byte(*byte)).count();
    if length == 0 {
        return if prefix.is_empty() {
            Vec::new()
        } else {
            vec![plain(prefix)]
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
    if let Some(after) = trimmed.strip_prefix("as ") {
        let after = after.trim_start();
        let length = after
            .bytes()
            .take_while(|byte| is_ident_byte(*byte))
            .count();
        *rest = &after[length..];
        return vec![Parsed {
            path,
            alias: Some(after[..length].to_owned()),
        }];
    }
    vec![plain(path)]
}

/// A name bound in a module: (the module, the name).
type BoundName = (Vec<String>, String);
/// (module, name) → the crate path a `use` in that module binds the name to.
type Bindings = std::collections::HashMap<BoundName, Vec<String>>;

/// What one file names, resolved to crate-root paths, and what its `use` items bind.
#[derive(Default)]
struct FileScan {
    references: Vec<Reference>,
    /// (module, name) → the crate path it stands for, for every `use` of a crate path: a
    /// re-export cannot launder a forbidden arrow.
    bindings: Vec<(BoundName, Vec<String>)>,
    /// Ways of naming crate items that the check could not follow.
    unfollowable: Vec<String>,
}

/// The child modules a file declares (`mod x;` or `mod x { … }`, outside test code).
fn declared_children(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("mod ") {
        let before = &rest[..at];
        rest = &rest[at + "mod ".len()..];
        let starts_item =
            before.trim_end().chars().last().is_none_or(|c| {
                matches!(c, ';' | '}' | '{' | ']' | ')') || before.ends_with("pub ")
            });
        if !starts_item || before.ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.push(name);
        }
    }
    names
}

/// The references one file makes, resolved to crate-root paths.
fn references_in(file: &str, module: &[String], source: &str) -> Vec<Reference> {
    scan_file(file, module, source).references
}

fn scan_file(file: &str, module: &[String], source: &str) -> FileScan {
    let code = without_test_modules(&code_only(source));
    let mut scan = FileScan::default();
    for alias in ["crate as ", "self as ", "extern crate self"] {
        if code.contains(alias) {
            scan.unfollowable.push(format!(
                "{file}: `{alias}…` renames the crate, which the layering check cannot follow"
            ));
        }
    }
    let mut resolved: Vec<(Parsed, Vec<String>)> = Vec::new();
    for parsed in paths_after(&code, "crate") {
        let path = parsed.path.clone();
        resolved.push((parsed, path));
    }
    // `super::` resolves from the file's module (a file's own inline test modules are removed
    // above, and other inline modules are refused below).
    for parsed in paths_after(&code, "super") {
        let mut path = module[..module.len().saturating_sub(1)].to_vec();
        let mut segments = parsed.path.iter().peekable();
        while segments.peek().is_some_and(|segment| *segment == "super") {
            segments.next();
            path.pop();
        }
        path.extend(segments.cloned());
        resolved.push((parsed, path));
    }
    // A path through a module this file declares (`pool::TargetPool` in `proxy/mod.rs`).
    for child in declared_children(&code) {
        for mut parsed in paths_after(&code, &child) {
            let mut path = module.to_vec();
            path.push(child.clone());
            path.append(&mut parsed.path);
            resolved.push((parsed, path));
        }
    }
    for (parsed, path) in resolved {
        if path.is_empty() {
            continue;
        }
        if path.last().is_some_and(|segment| segment == "*") {
            scan.unfollowable.push(format!(
                "{file}: a glob import of crate::{} hides what it names; name the items",
                path[..path.len() - 1].join("::")
            ));
            continue;
        }
        let name = parsed
            .alias
            .clone()
            .or_else(|| path.last().cloned())
            .unwrap_or_default();
        if name != "self" {
            scan.bindings.push(((module.to_vec(), name), path.clone()));
        }
        scan.references.push(Reference {
            file: file.to_owned(),
            from: module.to_vec(),
            to: path,
        });
    }
    scan
}

/// `path` with every prefix that a `use` bound to another path replaced by it, so a re-export
/// (`pub(crate) use pool::TargetPool` in `proxy`) names its origin.
fn through_bindings(path: &[String], bindings: &Bindings) -> Vec<String> {
    let mut current = path.to_vec();
    for _ in 0..16 {
        let replaced = (1..current.len()).find_map(|split| {
            let key = (current[..split].to_vec(), current[split].clone());
            let target = bindings.get(&key)?;
            (target.as_slice() != &current[..=split]).then(|| {
                let mut next = target.clone();
                next.extend_from_slice(&current[split + 1..]);
                next
            })
        });
        match replaced {
            Some(next) => current = next,
            None => break,
        }
    }
    current
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
    if !known_tops.contains(to_top) && !ROOT_ITEMS.contains(&to_top.as_str()) {
        return Some(format!(
            "{shown}: no module `{to_top}` at the crate root; the check cannot follow it"
        ));
    }
    if from_top != to_top && !EVERYWHERE.contains(&to_top.as_str()) && known_tops.contains(to_top) {
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

/// What the scan of `src/` found.
struct CrateScan {
    references: Vec<Reference>,
    /// The module of every file outside test code.
    modules: BTreeSet<Vec<String>>,
    tops: BTreeSet<String>,
    bindings: Bindings,
    unfollowable: Vec<String>,
}

/// Every reference in `src/` outside test code, the top-level modules, and the `use` bindings.
fn crate_references() -> CrateScan {
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
    let mut scan = CrateScan {
        references: Vec::new(),
        modules: BTreeSet::new(),
        tops: BTreeSet::new(),
        bindings: Default::default(),
        unfollowable: Vec::new(),
    };
    for (relative, module, source) in parsed {
        let Some(top) = module.first() else { continue };
        if top == "main" || top == "lib" {
            continue;
        }
        scan.tops.insert(top.clone());
        let in_test_module = (1..=module.len()).any(|len| test_only.contains(&module[..len]));
        if in_test_module {
            continue;
        }
        scan.modules.insert(module.clone());
        let file = scan_file(&relative.display().to_string(), &module, &source);
        scan.references.extend(file.references);
        scan.bindings.extend(file.bindings);
        scan.unfollowable.extend(file.unfollowable);
    }
    scan
}

#[test]
fn every_import_follows_the_arrows_of_design_section_3() {
    let scan = crate_references();
    assert!(
        scan.references.len() > 200,
        "the scan found only {} references: it is broken",
        scan.references.len()
    );
    for top in &scan.tops {
        assert!(
            allowed_tops(top).is_some(),
            "module `{top}` is not in the layering table: add its row (and to DESIGN §3)"
        );
    }
    let mut problems: BTreeSet<String> = scan.unfollowable.iter().cloned().collect();
    for reference in &scan.references {
        let origin = Reference {
            to: through_bindings(&reference.to, &scan.bindings),
            ..reference.clone()
        };
        for checked in [reference, &origin] {
            if let Some(problem) = violation(checked, &scan.tops) {
                problems.insert(problem);
            }
        }
    }
    assert!(
        problems.is_empty(),
        "imports against DESIGN §3:\n{}",
        problems.into_iter().collect::<Vec<_>>().join("\n")
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

#[test]
fn a_re_export_glob_or_alias_cannot_launder_an_arrow() {
    let tops: BTreeSet<String> = ["proxy"].into_iter().map(String::from).collect();
    let module = |path: &str| module_path(Path::new(path));
    let parent = scan_file(
        "proxy/mod.rs",
        &module("proxy/mod.rs"),
        "mod h1client;\nmod pool;\npub(crate) use pool::TargetPool as Kept;",
    );
    let codec = scan_file(
        "proxy/h1client.rs",
        &module("proxy/h1client.rs"),
        "use super::Kept;\nfn f() { let _ = crate::proxy::Kept::new(); }",
    );
    let bindings = parent.bindings.into_iter().chain(codec.bindings).collect();
    let laundered: Vec<String> = codec
        .references
        .iter()
        .map(|reference| through_bindings(&reference.to, &bindings).join("::"))
        .collect();
    assert_eq!(
        laundered,
        ["proxy::pool::TargetPool::new", "proxy::pool::TargetPool"]
    );
    let caught = codec.references.iter().any(|reference| {
        let origin = Reference {
            to: through_bindings(&reference.to, &bindings),
            ..reference.clone()
        };
        violation(&origin, &tops).is_some_and(|problem| problem.contains("must not name"))
    });
    assert!(caught, "the re-export hid the codec's use of its pool");

    let glob = scan_file("proxy/x.rs", &module("proxy/x.rs"), "use super::super::*;");
    assert_eq!(glob.unfollowable.len(), 1, "{:?}", glob.unfollowable);
    let alias = scan_file("proxy/x.rs", &module("proxy/x.rs"), "use crate as root;");
    assert_eq!(alias.unfollowable.len(), 1, "{:?}", alias.unfollowable);
    let unknown = Reference {
        file: "proxy/x.rs".into(),
        from: module("proxy/x.rs"),
        to: vec!["pool".into(), "TargetPool".into()],
    };
    assert!(violation(&unknown, &tops).is_some_and(|problem| problem.contains("no module")));
}

/// Sibling modules that still name each other, as `circles` shows them: none may be added,
/// and one that is broken must be taken off. (`proxy::h1client` and `proxy::body`,
/// `proxy::stream::connection` and `proxy::stream::relay` were the last two the README named.)
const KNOWN_CIRCLES: &[&str] = &[
    "balance: hash_table <-> maglev",
    "balance: hash_table <-> ring",
    "proxy: body <-> replay",
    "proxy: error <-> rate_limit",
    "proxy::forward: mirror <-> retry",
    "validate: limits <-> route",
];

/// The two sibling modules a reference joins, under their common parent: `proxy::body` naming
/// `proxy::h1client::ResponseBody` joins (`body`, `h1client`) under `proxy`. None when one is
/// inside the other (a parent names its children, a child its parent's items) or when what is
/// named under the common parent is an item, not a module.
fn siblings(
    reference: &Reference,
    modules: &BTreeSet<Vec<String>>,
) -> Option<(Vec<String>, String, String)> {
    let common = reference
        .from
        .iter()
        .zip(&reference.to)
        .take_while(|(a, b)| a == b)
        .count();
    let from = reference.from.get(common)?;
    let to = reference.to.get(common)?;
    let mut to_module = reference.to[..common].to_vec();
    to_module.push(to.clone());
    let is_module = modules.iter().any(|module| module.starts_with(&to_module));
    is_module.then(|| (reference.to[..common].to_vec(), from.clone(), to.clone()))
}

/// Pairs of sibling modules that name each other, shown as `parent: a <-> b`.
fn circles(references: &[Reference], modules: &BTreeSet<Vec<String>>) -> BTreeSet<String> {
    let arrows: BTreeSet<(Vec<String>, String, String)> = references
        .iter()
        .filter_map(|reference| siblings(reference, modules))
        .collect();
    arrows
        .iter()
        .filter(|(parent, from, to)| {
            from < to && arrows.contains(&(parent.clone(), to.clone(), from.clone()))
        })
        .map(|(parent, from, to)| format!("{}: {from} <-> {to}", parent.join("::")))
        .collect()
}

#[test]
fn no_two_sibling_modules_name_each_other() {
    let scan = crate_references();
    let references: Vec<Reference> = scan
        .references
        .iter()
        .map(|reference| Reference {
            to: through_bindings(&reference.to, &scan.bindings),
            ..reference.clone()
        })
        .collect();
    let found = circles(&references, &scan.modules);
    let known: BTreeSet<String> = KNOWN_CIRCLES
        .iter()
        .map(|circle| circle.to_string())
        .collect();
    let new: Vec<&String> = found.difference(&known).collect();
    assert!(
        new.is_empty(),
        "modules that name each other (move the shared piece below both): {new:#?}"
    );
    let gone: Vec<&String> = known.difference(&found).collect();
    assert!(
        gone.is_empty(),
        "circles no longer there: take them off KNOWN_CIRCLES: {gone:#?}"
    );
}

#[test]
fn a_circle_between_siblings_is_found() {
    let module = |path: &str| module_path(Path::new(path));
    let modules: BTreeSet<Vec<String>> = [
        "proxy/mod.rs",
        "proxy/body.rs",
        "proxy/h1client/mod.rs",
        "proxy/stream/relay.rs",
        "proxy/stream/connection.rs",
        "proxy/stream/mod.rs",
    ]
    .into_iter()
    .map(module)
    .collect();
    let mut references = references_in(
        "proxy/body.rs",
        &module("proxy/body.rs"),
        "use super::h1client::ResponseBody;",
    );
    references.extend(references_in(
        "proxy/h1client/encode.rs",
        &module("proxy/h1client/encode.rs"),
        "use crate::proxy::body::UpstreamRequestBody;",
    ));
    references.extend(references_in(
        "proxy/stream/relay.rs",
        &module("proxy/stream/relay.rs"),
        "use super::connection::Ended; use super::Shared;",
    ));
    references.extend(references_in(
        "proxy/stream/connection.rs",
        &module("proxy/stream/connection.rs"),
        "use super::relay::Progress; use super::Shared;",
    ));
    references.extend(references_in(
        "proxy/stream/mod.rs",
        &module("proxy/stream/mod.rs"),
        "mod relay; fn f() { relay::run(); }",
    ));
    let found: Vec<String> = circles(&references, &modules).into_iter().collect();
    assert_eq!(
        found,
        [
            "proxy: body <-> h1client",
            "proxy::stream: connection <-> relay"
        ]
    );
}

/// The rows of the README's layout table (`| path | owns |`): its two cells each.
fn layout_rows(readme: &str) -> Vec<(String, String)> {
    readme
        .lines()
        .skip_while(|line| line.trim() != "| path | owns |")
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| {
            let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
            let (paths, owns) = inner.split_once(" | ")?;
            Some((paths.trim().to_owned(), owns.trim().to_owned()))
        })
        .collect()
}

/// A backticked word that names a file or a folder: `pool.rs`, `h1client/`, `health/grpc.rs`.
fn is_path_word(word: &str) -> bool {
    (word.ends_with(".rs") || word.ends_with('/'))
        && !word.starts_with(['/', '.'])
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '/' | '.'))
}

/// The paths a cell names, each relative to a folder of `bases` (the first where it exists),
/// or the words that name nothing there. Inside parentheses, `` `dir/`: `` makes the words after
/// it (to the closing parenthesis) relative to that folder: `(`h1client/`: `encode.rs`, …)`.
fn cell_paths(cell: &str, bases: &[PathBuf]) -> (Vec<PathBuf>, Vec<String>) {
    let (mut found, mut missing) = (Vec::new(), Vec::new());
    // One folder per open parenthesis (and the cell itself), set by a `dir/`: inside it.
    let mut contexts: Vec<Option<String>> = vec![None];
    let mut rest = cell;
    while let Some(c) = rest.chars().next() {
        match c {
            '(' => contexts.push(None),
            ')' if contexts.len() > 1 => {
                contexts.pop();
            }
            '`' => {
                let Some(end) = rest[1..].find('`') else {
                    break;
                };
                let word = &rest[1..1 + end];
                rest = &rest[end + 2..];
                if !is_path_word(word) {
                    continue;
                }
                let context: String = contexts.iter().flatten().map(String::as_str).collect();
                let relative = format!("{context}{word}");
                match bases
                    .iter()
                    .map(|base| base.join(&relative))
                    .find(|path| path.exists())
                {
                    Some(path) => found.push(path),
                    None => missing.push(relative.clone()),
                }
                if word.ends_with('/') && rest.starts_with(':') {
                    if let Some(last) = contexts.last_mut() {
                        *last = Some(word.to_owned());
                    }
                }
                continue;
            }
            _ => {}
        }
        rest = &rest[c.len_utf8()..];
    }
    (found, missing)
}

/// What the layout table names, resolved in the tree under `root`, and the words of it that
/// name nothing there.
fn layout_named(readme: &str, root: &Path) -> (BTreeSet<PathBuf>, Vec<String>) {
    let mut named = BTreeSet::new();
    let mut missing = Vec::new();
    for (paths, owns) in layout_rows(readme) {
        let (row_paths, row_missing) = cell_paths(&paths, &[root.to_path_buf()]);
        missing.extend(row_missing);
        // A row's own words are relative to its folders, and to a file's module folder and
        // the folder the file is in (`src/validate.rs` names `validate/json.rs`).
        let mut bases = Vec::new();
        for path in &row_paths {
            if path.is_dir() {
                bases.push(path.clone());
            } else {
                bases.push(path.with_extension(""));
                bases.extend(path.parent().map(Path::to_path_buf));
            }
        }
        let (owned, owned_missing) = cell_paths(&owns, &bases);
        missing.extend(owned_missing);
        named.extend(row_paths);
        named.extend(owned);
    }
    let named = named
        .into_iter()
        .map(|path| path.components().collect::<PathBuf>())
        .collect();
    (named, missing)
}

/// Every source file of `src/` outside test-only modules.
fn architecture_files(src: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    source_files(src, &mut files);
    let mut test_only = BTreeSet::new();
    for path in &files {
        let source = std::fs::read_to_string(path).expect("a readable source file");
        let folder = if path.file_name().is_some_and(|name| name == "mod.rs") {
            path.parent().expect("a folder").to_path_buf()
        } else {
            path.with_extension("")
        };
        for name in test_module_files(&code_only(&source)) {
            test_only.insert(folder.join(format!("{name}.rs")));
            test_only.insert(folder.join(name));
        }
    }
    files
        .into_iter()
        .filter(|path| !test_only.iter().any(|test| path.starts_with(test)))
        .collect()
}

/// The files of `src/` the layout table does not name: a `mod.rs` is named with its folder.
fn unnamed_files(files: &[PathBuf], named: &BTreeSet<PathBuf>, root: &Path) -> Vec<String> {
    files
        .iter()
        .filter(|path| {
            let is_mod = path.file_name().is_some_and(|name| name == "mod.rs");
            let folder_named = is_mod && path.parent().is_some_and(|dir| named.contains(dir));
            !(named.contains(*path) || folder_named)
        })
        .map(|path| {
            path.strip_prefix(root)
                .unwrap_or(path)
                .display()
                .to_string()
        })
        .collect()
}

#[test]
fn the_readme_layout_table_names_every_source_file_and_nothing_else() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    assert!(
        layout_rows(&readme).len() > 10,
        "the README's layout table (| path | owns |) was not found"
    );
    let (named, missing) = layout_named(&readme, root);
    assert!(
        missing.is_empty(),
        "the README's layout table names what the tree does not have: {missing:?}"
    );
    let files = architecture_files(&root.join("src"));
    assert!(files.len() > 100, "only {} source files found", files.len());
    let unnamed = unnamed_files(&files, &named, root);
    assert!(
        unnamed.is_empty(),
        "source files the README's layout table does not name (add them to its row):\n{}",
        unnamed.join("\n")
    );
}

#[test]
fn the_layout_table_check_follows_folders_and_finds_strays() {
    let root = std::env::temp_dir().join(format!("raahi-layout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for file in [
        "src/main.rs",
        "src/proxy/mod.rs",
        "src/proxy/pool.rs",
        "src/proxy/h1client/mod.rs",
        "src/proxy/h1client/parse.rs",
        "src/proxy/h1client/tests.rs",
        "src/proxy/stray.rs",
    ] {
        let path = root.join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let text = if file.ends_with("h1client/mod.rs") {
            "mod parse;\n#[cfg(test)]\nmod tests;\n"
        } else {
            ""
        };
        std::fs::write(path, text).unwrap();
    }
    let readme = "# x\n\n| path | owns |\n|---|---|\n\
        | `src/main.rs` | the CLI |\n\
        | `src/proxy/` | the pool (`pool.rs`), the codec (`h1client/`: `parse.rs`, `gone.rs`) |\n\n";
    let (named, missing) = layout_named(readme, &root);
    assert_eq!(missing, ["h1client/gone.rs"]);
    let files = architecture_files(&root.join("src"));
    let unnamed = unnamed_files(&files, &named, &root);
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(unnamed, ["src/proxy/stray.rs"]);
}

#[test]
fn an_errors_causes_are_walked_only_in_error_chain() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let walks: Vec<String> = architecture_files(&src)
        .into_iter()
        .filter(|path| !path.ends_with("error_chain.rs"))
        .filter(|path| {
            let source = std::fs::read_to_string(path).expect("a readable source file");
            let code = without_test_modules(&code_only(&source));
            code.contains(".source()") || code.contains("Error::source(")
        })
        .map(|path| {
            path.strip_prefix(&src)
                .unwrap_or(&path)
                .display()
                .to_string()
        })
        .collect();
    assert!(
        walks.is_empty(),
        "walk an error's causes with crate::error_chain, not by hand: {walks:?}"
    );
}
