//! Op entry points: validate arguments, then call the buffer's backend.
