# phaselens recipes. `just --list` shows them all.

set shell := ["bash", "-euo", "pipefail", "-c"]

# Cargo profile shared by tests and runs (dependencies optimised, one warm target/).
target_dir := env_var_or_default("CARGO_TARGET_DIR", "target")
bin := target_dir + "/debug/phaselens"
# Backends compiled in. The test recipes build all three (flex, LibTorch, wgpu; the
# device is chosen at run time, and the backend matrix runs on each).
features := env_var_or_default("PHASELENS_FEATURES", "all-backends")
# The run recipes (build, run, patch-heads, train, ...) build the pure-Rust CPU backend
# (flex) alone on a fresh machine, which halves the first build (no LibTorch bindings, no
# wgpu); once an all-backends build is in the target folder (after `just test`), they
# use it, so they never rebuild the dependencies. PHASELENS_FEATURES overrides both.
run_features := env_var_or_default("PHASELENS_FEATURES", `ls "${CARGO_TARGET_DIR:-target}/debug/.fingerprint" 2>/dev/null | grep -q '^torch-sys-' && echo all-backends || echo flex`)

default:
    @just --list

# Build the CLI (backends: `run_features` above; `just backends-used` tells which).
build:
    cargo build --bin phaselens --features {{run_features}}

# The backends the run recipes build with here (flex alone until an all-backends build exists).
backends-used:
    @echo {{run_features}}

# Format the code (the experiment kinds are plain `pub mod` lines, so cargo fmt reaches them;
# examples/dependent is its own crate).
fmt:
    cargo fmt
    rustfmt --edition 2024 examples/dependent/build.rs examples/dependent/src/main.rs

# Check formatting (no build; part of `just test`).
fmt-check:
    cargo fmt --check
    rustfmt --edition 2024 --check examples/dependent/build.rs examples/dependent/src/main.rs

# Formatting + clippy with warnings as errors, at no extra compile: every build of
# phaselens itself runs through clippy-driver (`.cargo/config.toml`), so clippy lints
# while the test build compiles (the dependencies are compiled by rustc as always and
# reused). Cargo replays the warnings of up-to-date artifacts, so a warning of our crate
# (rustc's or clippy's, any target: lib, bin, tests, examples) fails this every time.
lint: fmt-check
    #!/usr/bin/env bash
    set -euo pipefail
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    color=never; [ -t 2 ] && color=always
    cargo test --no-run --features {{features}} --color "$color" 2>&1 | tee "$log"
    if sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -q '^warning'; then
        echo "lint: the warnings above (rustc's or clippy's) fail the lint; fix them" >&2
        exit 1
    fi

# One build with every backend; the backend matrix runs on flex, tch-cpu and wgpu.
# Run the whole test suite (what CI runs): formatting + lints (the test build), doc
# tests, the one test binary, the examples.
test: lint
    cargo test --doc --features {{features}}
    cargo nextest run --no-fail-fast --features {{features}}
    just examples

# Run the library examples (examples/: built by the test build above), then the
# dependent crate.
examples:
    cargo run --quiet --features {{features}} --example phase_sweep
    cargo run --quiet --features {{features}} --example cache_and_patch
    cargo run --quiet --features {{features}} --example audit
    cargo run --quiet --features {{features}} --example pretrained
    cargo run --quiet --features {{features}} --example compressor
    just dependent

# Build and run examples/dependent, a crate that depends on phaselens by path, as a new
# user would: copied to an empty folder (none of our cargo config reaches it) with our
# Cargo.lock (the same dependency versions), sharing our target folder so that no
# dependency is compiled again (phaselens itself is: a dependency's artifact differs from
# a workspace member's). Runs on LibTorch (tch-cpu) when built with it: that checks the rpath.
dependent:
    #!/usr/bin/env bash
    set -euo pipefail
    root=$PWD
    target=${CARGO_TARGET_DIR:-target}
    case $target in /*) ;; *) target=$root/$target ;; esac
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    cp -r examples/dependent/. Cargo.lock "$dir/"
    sed -i "s|path = \"../..\"|path = \"$root\"|" "$dir/Cargo.toml"
    # The same features as ours (PHASELENS_FEATURES), so the dependencies match too.
    list=$(echo "{{features}}" | sed 's/[ ,][ ,]*/", "/g; s/.*/"&"/')
    sed -i "s|features = \[\"all-backends\"\]|default-features = false, features = [$list]|" "$dir/Cargo.toml"
    device=cpu
    case ",{{features}}," in *,all-backends,*|*,tch,*) device=tch-cpu ;; esac
    cd "$dir"
    CARGO_TARGET_DIR=$target cargo run --quiet --offline -- "$root" "$device"

# List hook points.
hooks: build
    {{bin}} hooks

# Train one organism recipe (resumes from checkpoints).
train RECIPE: build
    {{bin}} train {{RECIPE}}

# Run any experiment TOML (tables, figures, report; resumes an interrupted run).
run EXP: build
    {{bin}} run {{EXP}}

# Activation patching per layer x head x source phase (e.g. `just patch-heads exp/v4pro.toml`).
patch-heads EXP="exp/v4pro.toml": build
    {{bin}} run {{EXP}}

# Single-head ablations (zero / mean / resample), relative accuracy change per phase.
ablate EXP="exp/w8s8-ablate.toml": build
    {{bin}} run {{EXP}}

# KV-head knockout (the paper's Figure 3) and layer-output replacement.
knockout EXP="exp/w8s8-knockout.toml": build
    {{bin}} run {{EXP}}

# Accuracy by phase group of every shipped organism (both protocols).
phase-sweep: build
    {{bin}} run experiments/phase-sweep.toml

# Redraw every figure and report from the tables under notebooks-data/ (no model runs).
figures: build
    {{bin}} figures

# Batched patching vs one forward per cell (cells/s and their ratio).
bench-patching EXP="exp/v4pro.toml": build
    {{bin}} bench patching {{EXP}}

# The backend equivalence matrix on this machine (device x check; docs/backends.md):
# always built with every backend (PHASELENS_FEATURES aside).
backends:
    cargo build --bin phaselens --features {{features}}
    {{bin}} backends

# Training steps/s of a recipe (flex; add --device tch-cpu on the binary for LibTorch).
bench-train RECIPE="experiments/organisms/kvc-w8s8.toml": build
    {{bin}} bench train {{RECIPE}}
