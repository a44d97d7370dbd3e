//! Progress with an ETA: an indicatif bar on a terminal, plain lines otherwise (logs,
//! CI, `just` piped to a file).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressMode {
    /// A bar when stderr is a terminal, else plain lines.
    #[default]
    Auto,
    /// Plain lines on stderr.
    Plain,
    /// Nothing (tests, the backend matrix, library calls); warnings go to the report only.
    Hidden,
}

/// Progress over a known number of units (cells).
pub struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    label: String,
    unit: &'static str,
    total: u64,
    done: u64,
    computed: u64,
    start: Instant,
    last_print: Instant,
}

fn fmt_secs(s: f64) -> String {
    if !s.is_finite() {
        return "?".into();
    }
    let s = s.round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

impl Progress {
    /// Progress over `total` units named `unit` (e.g. "cells").
    pub fn new(mode: ProgressMode, label: &str, unit: &'static str, total: u64) -> Self {
        let tty = std::io::stderr().is_terminal();
        let (bar, plain) = match mode {
            ProgressMode::Hidden => (None, false),
            ProgressMode::Plain => (None, true),
            ProgressMode::Auto if tty => {
                let b = ProgressBar::new(total);
                b.set_style(
                    ProgressStyle::with_template(
                        "{prefix} [{bar:30}] {pos}/{len} {msg}  elapsed {elapsed}  eta {eta}",
                    )
                    .expect("template")
                    .progress_chars("=> "),
                );
                b.set_prefix(label.to_string());
                b.set_message(unit);
                (Some(b), false)
            }
            ProgressMode::Auto => (None, true),
        };
        let now = Instant::now();
        Progress {
            bar,
            plain,
            label: label.to_string(),
            unit,
            total,
            done: 0,
            computed: 0,
            start: now,
            last_print: now - Duration::from_secs(60),
        }
    }

    /// Units found finished on disk (resume): they advance the count, not the rate.
    pub fn skip(&mut self, n: u64) {
        self.done += n;
        if let Some(b) = &self.bar {
            b.inc(n);
        }
    }

    /// Units computed now.
    pub fn inc(&mut self, n: u64) {
        self.done += n;
        self.computed += n;
        if let Some(b) = &self.bar {
            b.set_message(format!("{} ({:.1}/s)", self.unit, self.rate()));
            b.inc(n);
        } else if self.plain && self.last_print.elapsed() >= Duration::from_secs(2) {
            self.print();
        }
    }

    /// Units per second of computation so far.
    pub fn rate(&self) -> f64 {
        self.computed as f64 / self.start.elapsed().as_secs_f64().max(1e-9)
    }

    fn print(&mut self) {
        self.last_print = Instant::now();
        let rate = self.rate();
        let left = self.total.saturating_sub(self.done) as f64;
        let eta = if rate > 0.0 { left / rate } else { f64::NAN };
        eprintln!(
            "[{}] {}/{} {} ({:.0}%)  {:.1} {}/s  elapsed {}  eta {}",
            self.label,
            self.done,
            self.total,
            self.unit,
            100.0 * self.done as f64 / self.total.max(1) as f64,
            rate,
            self.unit,
            fmt_secs(self.start.elapsed().as_secs_f64()),
            fmt_secs(eta)
        );
    }

    /// Finish the bar (or print the last line).
    pub fn finish(&mut self) {
        if let Some(b) = &self.bar {
            b.finish();
        } else if self.plain {
            self.print();
        }
    }
}
