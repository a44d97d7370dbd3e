//! Command-line subcommands. Each file parses its arguments and calls the library.

pub mod bench;
pub mod forward;
pub mod hooks;
pub mod inspect;
pub mod train;
