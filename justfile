# phaselens recipes. `just --list` shows them all.

set shell := ["bash", "-euo", "pipefail", "-c"]

# Cargo profile shared by tests and runs (dependencies optimised, one warm target/).
bin := "target/debug/phaselens"

default:
    @just --list

# Build the CLI.
build:
    cargo build --bin phaselens

# Run the whole test suite (what CI runs), plus a compile check of the wgpu backend.
test:
    cargo nextest run --no-fail-fast
    cargo test --doc
    cargo check --features wgpu --lib

# List hook points.
hooks: build
    {{bin}} hooks

# Train one organism recipe (resumes from checkpoints).
train RECIPE: build
    {{bin}} train {{RECIPE}}
