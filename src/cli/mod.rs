//! Command-line subcommands. Each file parses its arguments and calls the library.

pub mod audit;
pub mod backends;
pub mod bench;
pub mod figures;
pub mod forward;
pub mod generate;
pub mod grid;
pub mod grid_shift;
pub mod hooks;
pub mod inspect;
pub mod plan;
pub mod run;
pub mod tokenize;
pub mod train;
pub mod view;
