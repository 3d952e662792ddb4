//! Bindings to the C launch API of `kernels/*.cu`.
