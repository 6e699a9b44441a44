//! The `rust-version` in Cargo.toml is a promise: the crate builds with that Rust. Clippy holds
//! our own code to it (`incompatible_msrv` reads it); this holds the locked dependencies to it,
//! so a `cargo update` that pulls in a crate needing a newer Rust fails here, not on a user's
//! machine.

use std::process::Command;

/// `1.90` or `1.90.1` as comparable numbers (a missing patch is 0).
fn version(text: &str) -> (u64, u64, u64) {
    let mut parts = text.split('.').map(|part| {
        part.parse::<u64>()
            .unwrap_or_else(|_| panic!("{text:?} is not a Rust version"))
    });
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    let patch = parts.next().unwrap_or(0);
    (major, minor, patch)
}

/// The host the tests run on, as rustc names it.
fn host_triple() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let output = Command::new(rustc)
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("host: "))
        .expect("rustc -vV names the host")
        .to_owned()
}

#[test]
fn every_locked_dependency_builds_with_our_rust_version() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    // This machine's packages only: the others are not downloaded by a build here, and asking
    // for them would need the network.
    let host = host_triple();
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--locked",
            "--format-version",
            "1",
            "--filter-platform",
            &host,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
    let packages = metadata["packages"].as_array().expect("a package list");
    let ours = packages
        .iter()
        .find(|package| package["name"] == "raahi")
        .expect("raahi is in its own metadata");
    let promised = ours["rust_version"]
        .as_str()
        .expect("Cargo.toml sets rust-version");
    let promised_version = version(promised);
    let too_new: Vec<String> = packages
        .iter()
        .filter_map(|package| {
            let needed = package["rust_version"].as_str()?;
            (version(needed) > promised_version).then(|| {
                format!(
                    "{} {} needs Rust {needed}",
                    package["name"].as_str().unwrap_or("?"),
                    package["version"].as_str().unwrap_or("?")
                )
            })
        })
        .collect();
    assert!(
        too_new.is_empty(),
        "Cargo.toml promises Rust {promised}, but the lockfile holds:\n{}",
        too_new.join("\n")
    );
    assert!(
        packages.len() > 100,
        "the metadata lists only {} packages: the check is not reading the lockfile",
        packages.len()
    );
}

#[test]
fn versions_compare_as_numbers() {
    assert!(version("1.100") > version("1.90"));
    assert!(version("1.90.1") > version("1.90"));
    assert_eq!(version("1.90"), (1, 90, 0));
}
