//! A one-line progress bar on stderr, redrawn in place with `\r`.
//!
//! Drawn only when stderr is a terminal, at most ten times a second, so piping the
//! output to a file or a test harness gets the summary lines and nothing else. Written
//! by hand: a bar is twenty lines, not a dependency.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

const BAR_WIDTH: usize = 30;
const REDRAW_PERIOD: Duration = Duration::from_millis(100);

pub struct Progress {
    label: String,
    total: u64,
    enabled: bool,
    last_draw: Option<Instant>,
}

impl Progress {
    /// A bar for `total` units of work, labelled `label`.
    pub fn new(label: &str, total: u64) -> Progress {
        Progress {
            label: label.to_string(),
            total: total.max(1),
            enabled: std::io::stderr().is_terminal(),
            last_draw: None,
        }
    }

    /// Shows `done` of the total, with `detail` after the bar.
    pub fn set(&mut self, done: u64, detail: &str) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if self
            .last_draw
            .is_some_and(|last| now.duration_since(last) < REDRAW_PERIOD)
        {
            return;
        }
        self.last_draw = Some(now);
        let done = done.min(self.total);
        let filled = (done as u128 * BAR_WIDTH as u128 / self.total as u128) as usize;
        let percent = done * 100 / self.total;
        let bar: String = std::iter::repeat_n('#', filled)
            .chain(std::iter::repeat_n('-', BAR_WIDTH - filled))
            .collect();
        let mut stderr = std::io::stderr().lock();
        // A progress bar that cannot be drawn is not worth failing the run for.
        let _ = write!(
            stderr,
            "\r\x1b[2K{:<18} [{bar}] {percent:>3}%  {detail}",
            self.label
        );
        let _ = stderr.flush();
    }

    /// Replaces the bar with `summary` on a line of its own.
    pub fn finish(&mut self, summary: &str) {
        let mut stderr = std::io::stderr().lock();
        if self.enabled {
            let _ = write!(stderr, "\r\x1b[2K");
        }
        let _ = writeln!(stderr, "{:<18} {summary}", self.label);
    }
}
