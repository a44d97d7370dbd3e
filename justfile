# phaselens recipes. `just --list` shows them all.

set shell := ["bash", "-euo", "pipefail", "-c"]

# Cargo profile shared by tests and runs (dependencies optimised, one warm target/).
bin := env_var_or_default("CARGO_TARGET_DIR", "target") + "/debug/phaselens"
# Backends compiled in: all three (flex, LibTorch, wgpu; the device is chosen at run
# time). `PHASELENS_FEATURES=flex just ...` builds the pure-Rust CPU backend only.
features := env_var_or_default("PHASELENS_FEATURES", "all-backends")

default:
    @just --list

# Build the CLI.
build:
    cargo build --bin phaselens --features {{features}}

# Format the code (the experiment kinds are plain `pub mod` lines, so cargo fmt reaches them).
fmt:
    cargo fmt

# Check formatting (no build; part of `just test`).
fmt-check:
    cargo fmt --check

# Formatting + clippy with warnings as errors. clippy checks every dependency again in
# check mode (a second compile of burn, polars, wgpu, ...), so CI runs `fmt-check` only.
lint: fmt-check
    cargo clippy --features {{features}} --all-targets -- -D warnings

# One build with every backend; the backend matrix runs on flex, tch-cpu and wgpu.
# Run the whole test suite (what CI runs): formatting, doc tests, the one test binary.
test: fmt-check
    cargo test --doc --features {{features}}
    cargo nextest run --no-fail-fast --features {{features}}
    just examples

# Run the library examples (examples/: built by the test build above).
examples:
    cargo run --quiet --features {{features}} --example phase_sweep
    cargo run --quiet --features {{features}} --example cache_and_patch

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

# The backend equivalence matrix on this machine (device x check; docs/backends.md).
backends: build
    {{bin}} backends

# Training steps/s of a recipe (flex; add --device tch-cpu on the binary for LibTorch).
bench-train RECIPE="experiments/organisms/kvc-w8s8.toml": build
    {{bin}} bench train {{RECIPE}}
