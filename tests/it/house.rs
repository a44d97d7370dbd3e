//! The repository's own settings that must agree with each other.

use std::collections::BTreeMap;
use std::path::Path;

/// `[profile.dev.package.*]` of a Cargo.toml: per package spec, its settings as text.
fn package_overrides(path: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc: toml::Table =
        toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let packages = doc
        .get("profile")
        .and_then(|p| p.get("dev"))
        .and_then(|d| d.get("package"))
        .and_then(|p| p.as_table())
        .unwrap_or_else(|| panic!("{}: no [profile.dev.package] tables", path.display()));
    packages
        .iter()
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect()
}

/// examples/dependent (built by `just dependent` in our target folder) compiles every
/// dependency with our settings, so that it reuses our build of them: a package whose
/// opt-level differed would be compiled a second time in CI.
#[test]
fn dependent_crate_mirrors_the_dependency_profile() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut ours = package_overrides(&root.join("Cargo.toml"));
    let mut theirs = package_overrides(&root.join("examples/dependent/Cargo.toml"));
    // phaselens is the workspace member here (opt-level 3 for the run recipes' build)
    // and a dependency there (built once per CI run, at 0): each sets its own.
    ours.remove("phaselens");
    theirs.remove("phaselens");
    assert!(
        ours.contains_key("*"),
        "Cargo.toml has no [profile.dev.package.\"*\"]"
    );
    for (k, v) in &ours {
        assert_eq!(
            theirs.get(k),
            Some(v),
            "[profile.dev.package.{k}] differs between Cargo.toml and examples/dependent/Cargo.toml"
        );
    }
    for k in theirs.keys() {
        assert!(
            ours.contains_key(k),
            "examples/dependent/Cargo.toml has [profile.dev.package.{k}], Cargo.toml does not"
        );
    }
}
