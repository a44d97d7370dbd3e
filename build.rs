//! Build script: with the `tch` feature, put LibTorch's `lib/` folder on the run-time
//! library path of every binary and test (an rpath), so `phaselens --device tch-cpu` and
//! `cargo nextest` find `libtorch_cpu.so` without `LD_LIBRARY_PATH`, and pass the folder
//! on to dependents (`links = "phaselens"`: their build scripts see
//! `DEP_PHASELENS_LIBTORCH_LIB`).
//!
//! The folder is the one torch-sys links against: `$LIBTORCH/lib` when `LIBTORCH` is set,
//! else (with `LIBTORCH_USE_PYTORCH=1`) the `lib/` folder of the `torch` package that the
//! active Python (`python` in a virtualenv, `python3` otherwise) imports.
//!
//! Also: the git commit the build comes from, as `PHASELENS_GIT_COMMIT` (`unknown` outside
//! a git checkout), which trainings record in `training.json` and their checkpoints'
//! `meta.json`. The script reruns when HEAD moves.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    git_commit();
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    if env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    if let Some(dir) = libtorch_lib_dir() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        // For dependents: a crate that depends on phaselens reads it as
        // DEP_PHASELENS_LIBTORCH_LIB in its own build script (examples/dependent/build.rs);
        // cargo does not pass this crate's link arguments on.
        println!("cargo:libtorch_lib={}", dir.display());
    } else {
        println!(
            "cargo:warning=phaselens: the tch feature is on but LibTorch's lib/ folder was not found \
             (set LIBTORCH, or LIBTORCH_USE_PYTORCH=1 with torch installed); binaries will need \
             LD_LIBRARY_PATH"
        );
    }
}

fn libtorch_lib_dir() -> Option<PathBuf> {
    if let Some(root) = env::var_os("LIBTORCH") {
        let lib = PathBuf::from(root).join("lib");
        return lib.is_dir().then_some(lib);
    }
    env::var_os("LIBTORCH_USE_PYTORCH")?;
    let python = if env::var_os("VIRTUAL_ENV").is_some() {
        "python"
    } else {
        "python3"
    };
    let out = Command::new(python)
        .args([
            "-c",
            "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let lib = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    lib.is_dir().then_some(lib)
}

/// `PHASELENS_GIT_COMMIT`: `git rev-parse HEAD` of the source folder, rerun when HEAD or
/// the branch it names moves.
fn git_commit() {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "HEAD"]);
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let dir = PathBuf::from(dir);
        println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        println!(
            "cargo:rerun-if-changed={}",
            dir.join("packed-refs").display()
        );
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={}", dir.join(branch).display());
        }
    }
    println!(
        "cargo:rustc-env=PHASELENS_GIT_COMMIT={}",
        commit.as_deref().unwrap_or("unknown")
    );
}
