//! The host side of `kernels/*.cu`: safe and `unsafe` wrappers over the generated launch API
//! ([`crate::sys::kernels`]), one file per kernel family, plus the window context and its byte map
//! ([`intranode`]: `Ctx`, the control area, the status block, streams and device guards), the
//! host-mapped LL rank mask and the transport descriptors. Every launch is asynchronous on the
//! stream it gets and CUDA-graph capturable; the launch contract is in [`intranode`].

/// `pub const NAME: ty = DEK_NAME as ty;` for each `NAME = DEK_NAME`: constants of the generated
/// kernel header ([`crate::sys::kernels`]) under the Rust names of the module that invokes it.
macro_rules! c_consts {
    ($ty:ty; $($name:ident = $c:ident),* $(,)?) => {
        $(pub const $name: $ty = crate::sys::kernels::$c as $ty;)*
    };
}
pub(crate) use c_consts;

pub mod global_barrier;
pub mod host_mask;
pub mod internode;
pub mod intranode;
pub mod layout;
pub mod ll_rows;
pub mod logfmt;
pub mod low_latency;
pub mod transport;

/// Fails when the generated struct `T` and the kernels' C struct `c_name` (`c_bytes` as the
/// kernels' build measured it) differ in size: a library whose kernels were built from another
/// header than its bindings.
pub(crate) fn check_struct_size<T>(op: &'static str, c_name: &str, c_bytes: usize) -> crate::error::Result<()> {
    let rust = std::mem::size_of::<T>();
    crate::ensure!(c_bytes == rust, op, "internal: {c_name} is {c_bytes} bytes in C but {rust} in Rust");
    Ok(())
}
