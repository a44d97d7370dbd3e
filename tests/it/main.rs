//! The one integration-test binary: every area of the suite is a module here, so the
//! test build links burn, polars, LibTorch and wgpu once (not once per test file).
//! nextest still runs each test in its own process.
//!
//! Run one area: `cargo nextest run --features all-backends --test it hostile_cli::`.

mod common;
mod grid_common;

mod attention_blocks;
mod audit;
mod backends;
mod bench_train;
mod checkpoint;
mod compressors;
mod deepseek_v4_fp4;
mod deepseek_v4_memory;
mod deepseek_v4_parity;
mod deepseek_v4_plan;
mod deepseek_v4_realwidth;
mod deepseek_v4_suffix;
mod deepseek_v4_token_blocks;
mod edges;
mod gguf;
mod grid;
mod grid_frontier;
mod grid_shift;
mod grid_slurm;
mod grid_slurm_states;
mod hostile_cli;
mod hostile_inputs;
mod house;
mod indexer_distill;
mod kvc_core;
mod memory_estimates;
mod model_contract;
mod organism_v4;
mod overlays;
mod patch_text;
mod placement;
mod precision;
mod pretrained;
mod recipes;
mod run_shards;
mod runner_kinds;
mod runner_kinds_atp;
mod runner_kinds_diagnostics;
mod runner_kinds_path;
mod runner_long_context;
mod runner_patch;
mod selection_hooks;
mod stored_weights;
mod text_tasks;
mod threads;
mod tokenizer;
mod train_init;
mod train_resume;
mod view_browser;
