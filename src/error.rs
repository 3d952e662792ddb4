//! The crate's one error type. Every message that reaches Python starts with the op name
//! (`deep_ep::dispatch: ...`), so a user can tell which call and which argument was wrong.

use std::fmt;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the library, grouped by who must act on it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller passed an argument that does not meet the op's contract.
    #[error("{op}: {msg}")]
    InvalidArgument { op: &'static str, msg: String },

    /// A wait for peers ran past `DEEP_EP_TIMEOUT_MS`.
    #[error("{op}: timed out after {timeout_ms} ms on rank {rank} waiting for rank(s) {peers:?} ({what})")]
    Timeout { op: &'static str, rank: usize, peers: Vec<usize>, timeout_ms: u64, what: String },

    /// Ctrl-C (SIGINT) while waiting for peers: the collective was left half done.
    #[error("{op}: interrupted (SIGINT) on rank {rank} while waiting for rank(s) {peers:?} ({what})")]
    Interrupted { op: &'static str, rank: usize, peers: Vec<usize>, what: String },

    /// A peer gave up a collective call that this rank's call pairs with (its wait timed out, or
    /// it masked this rank): the ranks' calls are out of step for good, so the buffer must be
    /// recreated, as after a timeout (the peers' buffers are already unusable or masked this rank).
    #[error("{op}: {msg}")]
    OutOfStep { op: &'static str, msg: String },

    /// The requested feature exists in the API but is not built for this backend yet.
    #[error("{op}: {feature} is not implemented on the {backend} backend yet")]
    NotImplemented { op: &'static str, backend: &'static str, feature: &'static str },

    /// The backend was not compiled into this build of the library.
    #[error("{op}: backend '{backend}' is not compiled into this library (cargo feature '{feature}')")]
    NotCompiled { op: &'static str, backend: String, feature: &'static str },

    /// A buffer handle that was never created, or was destroyed, or is poisoned.
    #[error("{op}: {msg}")]
    BadHandle { op: &'static str, msg: String },

    /// An operating-system call failed (shared memory, files).
    #[error("{op}: {what}: {source}")]
    Os { op: &'static str, what: String, source: std::io::Error },

    /// A CUDA or NCCL call failed.
    #[error("{op}: {what} failed: {detail}")]
    Device { op: &'static str, what: String, detail: String },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(op: &'static str, msg: impl fmt::Display) -> Self {
        Error::InvalidArgument { op, msg: msg.to_string() }
    }

    /// Whether the error leaves the buffer's shared state out of step across ranks
    /// (a timed-out collective): such a buffer must be destroyed and created again.
    pub fn poisons_buffer(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::Interrupted { .. } | Error::OutOfStep { .. })
    }

    /// The error of a wait for `peers` that ended by `end` (timed out or interrupted).
    pub fn wait_ended(end: WaitEnd, op: &'static str, rank: usize, peers: Vec<usize>, timeout_ms: u64, what: String) -> Self {
        match end {
            WaitEnd::TimedOut => Error::Timeout { op, rank, peers, timeout_ms, what },
            WaitEnd::Interrupted => Error::Interrupted { op, rank, peers, what },
        }
    }
}

/// Why a host wait for peers ended without them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WaitEnd {
    /// `DEEP_EP_TIMEOUT_MS` ran out.
    TimedOut,
    /// The user pressed Ctrl-C ([`crate::interrupt`]).
    Interrupted,
}

/// `ensure!(cond, op, "fmt", args..)` returns an [`Error::InvalidArgument`] when `cond` is false.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $op:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::Error::invalid($op, format!($($fmt)+)));
        }
    };
}
