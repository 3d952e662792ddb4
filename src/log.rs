//! A tiny stderr logger. One line per event, `[deep_ep rank R] level: message`, filtered by
//! `DEEP_EP_LOG` (`off`, `warn` (default), `info`, `debug`; read once, see
//! [`log_level`]; the other knobs are in `crate::settings`). Events: buffer create/destroy (info), op entry (debug),
//! timeouts and refusals of poisoned buffers (warn).

use std::fmt;
use std::io::Write;

/// Verbosity, ordered: a level prints every event at or below it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Nothing.
    Off = 0,
    /// Timeouts, poisoned buffers.
    Warn = 1,
    /// Plus buffer creation and destruction.
    Info = 2,
    /// Plus every op entry.
    Debug = 3,
}

impl Level {
    /// Parses a `DEEP_EP_LOG` value (case-insensitive); `None` for an unknown one.
    pub fn parse(s: &str) -> Option<Level> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "none" | "0" => Some(Level::Off),
            "warn" | "warning" | "1" => Some(Level::Warn),
            "info" | "2" => Some(Level::Info),
            "debug" | "trace" | "3" => Some(Level::Debug),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Level::Off => "off",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

/// `DEEP_EP_LOG`: `off`, `warn` (default), `info` or `debug`; read once per process. An
/// unknown value keeps the default and says so once on stderr.
pub fn log_level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| match std::env::var("DEEP_EP_LOG") {
        Err(_) => Level::Warn,
        Ok(v) if v.trim().is_empty() => Level::Warn,
        Ok(v) => Level::parse(&v).unwrap_or_else(|| {
            eprintln!("[deep_ep] warn: DEEP_EP_LOG={v:?} is not one of off, warn, info, debug; using warn");
            Level::Warn
        }),
    })
}

/// Whether events of `level` are printed.
pub fn enabled(level: Level) -> bool {
    level != Level::Off && level <= log_level()
}

/// The line printed for an event (without the newline).
pub fn format_line(level: Level, rank: Option<usize>, args: fmt::Arguments) -> String {
    match rank {
        Some(r) => format!("[deep_ep rank {r}] {}: {args}", level.name()),
        None => format!("[deep_ep] {}: {args}", level.name()),
    }
}

/// Writes one line to stderr if `level` is enabled (one `write` call, so lines of concurrent
/// ranks do not interleave).
pub fn write(level: Level, rank: Option<usize>, args: fmt::Arguments) {
    if enabled(level) {
        let line = format_line(level, rank, args) + "\n";
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// `log_at!(Level::Info, Some(rank), "fmt", args..)`: logs one line when the level is enabled.
#[macro_export]
macro_rules! log_at {
    ($level:expr, $rank:expr, $($fmt:tt)+) => {
        if $crate::log::enabled($level) {
            $crate::log::write($level, $rank, format_args!($($fmt)+));
        }
    };
}

/// `log_warn!(rank, "fmt", args..)` with `rank: Option<usize>`.
#[macro_export]
macro_rules! log_warn {
    ($rank:expr, $($fmt:tt)+) => { $crate::log_at!($crate::log::Level::Warn, $rank, $($fmt)+) };
}

/// `log_info!(rank, "fmt", args..)` with `rank: Option<usize>`.
#[macro_export]
macro_rules! log_info {
    ($rank:expr, $($fmt:tt)+) => { $crate::log_at!($crate::log::Level::Info, $rank, $($fmt)+) };
}

/// `log_debug!(rank, "fmt", args..)` with `rank: Option<usize>`.
#[macro_export]
macro_rules! log_debug {
    ($rank:expr, $($fmt:tt)+) => { $crate::log_at!($crate::log::Level::Debug, $rank, $($fmt)+) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_order() {
        assert_eq!(Level::parse("INFO"), Some(Level::Info));
        assert_eq!(Level::parse(" debug "), Some(Level::Debug));
        assert_eq!(Level::parse("off"), Some(Level::Off));
        assert_eq!(Level::parse("warning"), Some(Level::Warn));
        assert_eq!(Level::parse("verbose"), None);
        assert!(Level::Warn < Level::Info && Level::Info < Level::Debug);
    }

    #[test]
    fn line_format() {
        assert_eq!(format_line(Level::Warn, Some(3), format_args!("buffer {} poisoned", 7)), "[deep_ep rank 3] warn: buffer 7 poisoned");
        assert_eq!(format_line(Level::Info, None, format_args!("x")), "[deep_ep] info: x");
    }
}
