//! The `extern "C"` API called by `torch_ops/`.
