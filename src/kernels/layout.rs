//! The dispatch-layout launcher and CUDA error texts over the C launch API of `kernels/*.cu`
//! (`kernels/deep_ep_kernels.h`, declarations generated into `crate::sys::kernels`). Every C function returns a `cudaError_t` as `i32`; [`check`] turns a
//! nonzero status into [`Error::Device`] carrying the CUDA error name.
//!
//! Streams are raw `cudaStream_t` values (`*mut c_void`, null = legacy default stream); launches
//! are asynchronous on them and nothing here synchronises the host.

use crate::error::{Error, Result};
use crate::sys::kernels::*;
use crate::tensor::{DType, Device, TensorRef};
use std::ffi::{c_char, c_int, c_void, CStr};

fn static_str(p: *const c_char) -> &'static str {
    if p.is_null() {
        return "unknown";
    }
    // SAFETY: cudart returns pointers to static NUL-terminated strings that live forever.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("unknown")
}

/// `"cudaErrorInvalidValue (invalid argument)"` for a `cudaError_t` value. Needs no device.
pub fn cuda_error_text(status: i32) -> String {
    // SAFETY: both functions only look the value up in a static table.
    let (name, text) = unsafe { (dek_cuda_error_name(status), dek_cuda_error_string(status)) };
    format!("{} ({})", static_str(name), static_str(text))
}

/// Maps a `cudaError_t` to `Ok` or [`Error::Device`] for `op`/`what`.
pub fn check(status: i32, op: &'static str, what: &str) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(Error::Device { op, what: what.to_string(), detail: cuda_error_text(status) })
    }
}

/// Number of visible CUDA devices; an error when no driver or device can be used.
pub fn device_count() -> Result<usize> {
    let mut n: c_int = 0;
    // SAFETY: writes one int through a valid pointer.
    check(unsafe { dek_cuda_device_count(&mut n) }, "deep_ep::cuda", "cudaGetDeviceCount")?;
    Ok(n.max(0) as usize)
}

const LAYOUT_OP: &str = crate::op_names::GET_DISPATCH_LAYOUT;

fn to_c_int(v: usize, name: &str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::invalid(LAYOUT_OP, format!("{name} = {v} does not fit in int32")))
}

/// Launches `get_dispatch_layout` on `stream` (asynchronous). Semantics are those of
/// [`crate::layout::dispatch_layout`], bit for bit.
///
/// - `topk_idx`: `[N, K]` int32 or int64, contiguous, on a CUDA device (global expert ids; ids
///   outside `[0, num_experts)`, e.g. −1, are ignored).
/// - `num_tokens_per_rank`: out `[R]` int32. `num_tokens_per_rdma_rank`: out `[R / 8]` int32,
///   required when `R > 8`. `num_tokens_per_expert`: out `[E]` int32.
///   `is_token_in_rank`: out `[N, R]` bool. All contiguous, on the same device as `topk_idx`.
/// - `stream`: the `cudaStream_t` to launch on, current device = the tensors' device.
///
/// The caller (`crate::ops`) validates shapes, dtypes and devices; this checks only what keeps
/// the launch memory-safe (rank, dtype, sizes that fit in `int`), and the C side checks the rest
/// (`E % R == 0`, `R % D == 0` above D ranks) and reports `cudaErrorInvalidValue`.
/// Sound as a safe function because a [`TensorRef`] carries a non-null pointer only when
/// `api::buffer` built it from a live tensor, and the C side refuses null outputs/inputs of nonzero
/// size (`cudaErrorInvalidValue`); `stream` is an opaque handle that is never dereferenced here.
#[allow(clippy::too_many_arguments, clippy::not_unsafe_ptr_arg_deref)]
pub fn dispatch_layout(
    topk_idx: &TensorRef,
    num_experts: usize,
    num_ranks: usize,
    num_tokens_per_rank: &TensorRef,
    num_tokens_per_rdma_rank: Option<&TensorRef>,
    num_tokens_per_expert: &TensorRef,
    is_token_in_rank: &TensorRef,
    nvl_domain: usize,
    stream: *mut c_void,
) -> Result<()> {
    let is_int64 = match topk_idx.dtype {
        DType::Int64 => 1,
        DType::Int32 => 0,
        d => return Err(Error::invalid(LAYOUT_OP, format!("topk_idx must be int32 or int64, got {d}"))),
    };
    if topk_idx.ndim() != 2 {
        return Err(Error::invalid(LAYOUT_OP, format!("topk_idx must be 2-D, got shape {:?}", topk_idx.sizes())));
    }
    let (n, k) = (topk_idx.size(0), topk_idx.size(1));
    if nvl_domain == 0 || nvl_domain > i32::MAX as usize {
        return Err(Error::invalid(LAYOUT_OP, format!("NVLink domain size must be >= 1, got {nvl_domain}")));
    }
    let rdma_len = if num_ranks > nvl_domain { num_ranks / nvl_domain } else { 0 };
    // Memory safety of the launch rests on these sizes; the full validation is the caller's.
    // An empty tensor counts as contiguous whatever its strides (as in torch).
    let dense = |t: &TensorRef| t.numel() == 0 || t.is_contiguous();
    let sized = |t: &TensorRef, len: usize, dtype: DType| t.dtype == dtype && t.numel() == len && dense(t);
    let outputs_ok = sized(num_tokens_per_rank, num_ranks, DType::Int32)
        && sized(num_tokens_per_expert, num_experts, DType::Int32)
        && sized(is_token_in_rank, n * num_ranks, DType::Bool)
        && (rdma_len == 0 || num_tokens_per_rdma_rank.is_some_and(|t| sized(t, rdma_len, DType::Int32)));
    if !outputs_ok || !dense(topk_idx) {
        return Err(Error::invalid(LAYOUT_OP, "output tensors do not match topk_idx, num_ranks and num_experts"));
    }
    debug_assert!(matches!(topk_idx.device, Device::Cuda(_)), "dispatch_layout on {}", topk_idx.device);
    let rdma_ptr = num_tokens_per_rdma_rank.map_or(std::ptr::null_mut(), |t| t.data_ptr() as *mut c_int);
    // SAFETY: every pointer is the data of a live device tensor of the size checked above (the
    // op keeps them alive for the call and the stream orders later uses); the kernel reads N*K
    // ids and writes R, G, E and N*R elements, exactly those sizes.
    let status = unsafe {
        dek_dispatch_layout(
            topk_idx.data_ptr() as *const c_void,
            is_int64,
            to_c_int(n, "num_tokens")?,
            to_c_int(k, "num_topk")?,
            to_c_int(num_ranks, "num_ranks")?,
            to_c_int(num_experts, "num_experts")?,
            num_tokens_per_rank.data_ptr() as *mut c_int,
            rdma_ptr,
            num_tokens_per_expert.data_ptr() as *mut c_int,
            is_token_in_rank.data_ptr() as *mut bool,
            nvl_domain as c_int,
            stream,
        )
    };
    check(status, LAYOUT_OP, "dispatch_layout kernel launch")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{dispatch_layout as reference, Layout};

    /// A device allocation freed on drop (tests only).
    struct DeviceBuf {
        ptr: *mut c_void,
        bytes: usize,
    }

    impl DeviceBuf {
        fn new(bytes: usize) -> DeviceBuf {
            let mut ptr = std::ptr::null_mut();
            // SAFETY: cudaMalloc writes one pointer; a zero-byte request still gets a valid slot.
            let st = unsafe { dek_cuda_malloc(&mut ptr, bytes.max(1)) };
            check(st, "test", "cudaMalloc").expect("cudaMalloc");
            // Garbage first, so a test notices any element the kernel forgets to write.
            let junk = vec![0xA5u8; bytes];
            // SAFETY: both buffers hold `bytes` bytes.
            check(unsafe { dek_cuda_memcpy_htod(ptr, junk.as_ptr().cast(), bytes) }, "test", "memcpy").expect("memcpy");
            DeviceBuf { ptr, bytes }
        }

        fn upload<T: Copy>(v: &[T]) -> DeviceBuf {
            let b = DeviceBuf::new(std::mem::size_of_val(v));
            // SAFETY: the allocation holds exactly size_of_val(v) bytes.
            check(unsafe { dek_cuda_memcpy_htod(b.ptr, v.as_ptr().cast(), b.bytes) }, "test", "memcpy").expect("memcpy");
            b
        }

        fn download<T: Copy + Default>(&self) -> Vec<T> {
            let mut v = vec![T::default(); self.bytes / std::mem::size_of::<T>()];
            // SAFETY: v holds `bytes` bytes; the copy synchronises with the default stream.
            check(unsafe { dek_cuda_memcpy_dtoh(v.as_mut_ptr().cast(), self.ptr, self.bytes) }, "test", "memcpy").expect("memcpy");
            v
        }

        fn tensor(&self, dtype: DType, sizes: &[i64]) -> TensorRef {
            let mut t = TensorRef::meta(dtype, Device::Cuda(0), sizes);
            t.data = self.ptr.cast();
            t
        }
    }

    impl Drop for DeviceBuf {
        fn drop(&mut self) {
            // SAFETY: ptr came from cudaMalloc and is freed once.
            let _ = unsafe { dek_cuda_free(self.ptr) };
        }
    }

    /// xorshift64*: deterministic ids without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
    }

    /// Random top-k ids: mostly valid experts, some −1, some out-of-range values.
    fn random_topk(rng: &mut Rng, n: usize, k: usize, e: usize, wide: bool) -> Vec<i64> {
        (0..n * k)
            .map(|_| match rng.next() % 16 {
                0 => -1,
                1 => e as i64,
                2 if wide => (1i64 << 32) + (rng.next() % e.max(1) as u64) as i64,
                3 => -((rng.next() % 1000) as i64) - 2,
                _ => (rng.next() % e.max(1) as u64) as i64,
            })
            .collect()
    }

    fn run_gpu(ids: &[i64], int64: bool, n: usize, k: usize, e: usize, r: usize, d: usize) -> Layout {
        let g = if r > d { r / d } else { 0 };
        let idx = if int64 { DeviceBuf::upload(ids) } else { DeviceBuf::upload(&ids.iter().map(|&v| v as i32).collect::<Vec<_>>()) };
        let (per_rank, per_node, per_expert, in_rank) =
            (DeviceBuf::new(r * 4), DeviceBuf::new(g * 4), DeviceBuf::new(e * 4), DeviceBuf::new(n * r));
        let dt = if int64 { DType::Int64 } else { DType::Int32 };
        let rdma = per_node.tensor(DType::Int32, &[g as i64]);
        dispatch_layout(
            &idx.tensor(dt, &[n as i64, k as i64]),
            e,
            r,
            &per_rank.tensor(DType::Int32, &[r as i64]),
            (g > 0).then_some(&rdma),
            &per_expert.tensor(DType::Int32, &[e as i64]),
            &in_rank.tensor(DType::Bool, &[n as i64, r as i64]),
            d,
            std::ptr::null_mut(),
        )
        .expect("launch");
        // SAFETY: synchronises the legacy default stream.
        check(unsafe { dek_cuda_stream_synchronize(std::ptr::null_mut()) }, "test", "sync").expect("kernel");
        Layout {
            num_tokens_per_rank: per_rank.download(),
            num_tokens_per_rdma_rank: per_node.download(),
            num_tokens_per_expert: per_expert.download(),
            is_token_in_rank: in_rank
                .download::<u8>()
                .into_iter()
                .map(|b| {
                    assert!(b <= 1, "is_token_in_rank byte {b} was not written");
                    b == 1
                })
                .collect(),
        }
    }

    fn gpu_available() -> bool {
        match device_count() {
            Ok(n) if n > 0 => {
                // SAFETY: selects device 0, which exists.
                check(unsafe { dek_cuda_set_device(0) }, "test", "cudaSetDevice").is_ok()
            }
            other => {
                eprintln!("skipping GPU test: {other:?}");
                false
            }
        }
    }

    #[test]
    fn error_text_needs_no_device() {
        assert_eq!(cuda_error_text(1), "cudaErrorInvalidValue (invalid argument)");
        assert!(check(0, "op", "x").is_ok());
        let e = check(2, "deep_ep::x", "cudaMalloc").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.starts_with("deep_ep::x: cudaMalloc failed: cudaErrorMemoryAllocation"), "{e}");
    }

    #[test]
    fn bad_arguments_are_errors_before_any_device_work() {
        let t = |d, s: &[i64]| TensorRef::meta(d, Device::Cuda(0), s);
        let (idx, in_rank) = (t(DType::Int64, &[4, 2]), t(DType::Bool, &[4, 3]));
        // E % R != 0 is refused by the C side with cudaErrorInvalidValue (no launch, no device).
        let e = dispatch_layout(&idx, 8, 3, &t(DType::Int32, &[3]), None, &t(DType::Int32, &[8]), &in_rank, 8, std::ptr::null_mut());
        let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("deep_ep::get_dispatch_layout: dispatch_layout kernel launch failed: cudaErrorInvalidValue"), "{msg}");
        // Wrong output sizes and dtypes are refused on the Rust side.
        let e = dispatch_layout(&idx, 8, 4, &t(DType::Int32, &[3]), None, &t(DType::Int32, &[8]), &in_rank, 8, std::ptr::null_mut());
        assert!(matches!(e, Err(Error::InvalidArgument { .. })));
        // (ids, E, R, D): refused on the Rust side, before any launch.
        let refused = |ids: &TensorRef, e: usize, r: usize, d: usize| {
            let (ntpr, ntpe, in_rank) = (t(DType::Int32, &[r as i64]), t(DType::Int32, &[e as i64]), t(DType::Bool, &[4, r as i64]));
            let got = dispatch_layout(ids, e, r, &ntpr, None, &ntpe, &in_rank, d, std::ptr::null_mut());
            assert!(matches!(got, Err(Error::InvalidArgument { .. })), "E {e} R {r} D {d}");
        };
        refused(&t(DType::Float32, &[4, 2]), 8, 4, 8); // float ids
                                                       // More than D ranks needs the per-node output (D = 8, and D = 2 with 4 ranks).
        refused(&idx, 16, 16, 8);
        refused(&idx, 8, 4, 2);
        refused(&idx, 8, 4, 0); // a domain size of 0 is refused before the launch
    }

    #[test]
    fn gpu_layout_matches_reference() {
        if !gpu_available() {
            return;
        }
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        // (N, K, E, R): empty, tiny, one block (direct store), several blocks (memset + atomics),
        // internode (per-node counts), and E too large for shared counters.
        let cases = [
            (0, 8, 256, 8),
            (1, 1, 8, 8),
            (7, 0, 16, 4),
            (5, 8, 256, 4),
            (2048, 8, 256, 8),
            (4096, 8, 256, 8),
            (3000, 9, 288, 32),
            (20000, 6, 64, 16),
            (300, 8, 16384, 8),
            (70000, 8, 256, 64),
            (100, 4, 0, 2),
            (1000, 1, 32, 8),
            (999, 3, 24, 8),
            (777, 32, 64, 8),
            (500, 40, 64, 8),
        ];
        for &(n, k, e, r) in &cases {
            for int64 in [false, true] {
                let ids = random_topk(&mut rng, n, k, e, int64);
                let got = run_gpu(&ids, int64, n, k, e, r, 8);
                let want = reference(&ids.iter().map(|&v| if int64 { v } else { v as i32 as i64 }).collect::<Vec<_>>(), n, k, e, r);
                assert_eq!(got, want, "N={n} K={k} E={e} R={r} int64={int64}");
            }
        }
        // Emulated nodes smaller than 8 (DEEP_EP_NVL_DOMAIN_SIZE): per-node counts over D ranks.
        for &(n, k, e, r, d) in &[(1000, 8, 64, 4, 2), (3000, 9, 288, 8, 4), (777, 32, 64, 8, 1), (5, 2, 16, 4, 4)] {
            let ids = random_topk(&mut rng, n, k, e, true);
            let want = crate::layout::dispatch_layout_in_domains(&ids, n, k, e, r, d);
            assert_eq!(run_gpu(&ids, true, n, k, e, r, d), want, "N={n} K={k} E={e} R={r} D={d}");
        }
    }

    #[test]
    fn gpu_layout_timing() {
        if !gpu_available() {
            return;
        }
        let mut rng = Rng(7);
        for &(n, k, e, r) in &[(4096usize, 8usize, 256usize, 8usize), (16384, 8, 256, 8), (128, 8, 288, 8)] {
            let ids = random_topk(&mut rng, n, k, e, true);
            let idx = DeviceBuf::upload(&ids);
            let (a, b, c) = (DeviceBuf::new(r * 4), DeviceBuf::new(e * 4), DeviceBuf::new(n * r));
            let (ti, ta, tb, tc) = (
                idx.tensor(DType::Int64, &[n as i64, k as i64]),
                a.tensor(DType::Int32, &[r as i64]),
                b.tensor(DType::Int32, &[e as i64]),
                c.tensor(DType::Bool, &[n as i64, r as i64]),
            );
            let iters = 2000;
            let run = || {
                for _ in 0..iters {
                    dispatch_layout(&ti, e, r, &ta, None, &tb, &tc, 8, std::ptr::null_mut()).expect("launch");
                }
                // SAFETY: synchronises the legacy default stream.
                check(unsafe { dek_cuda_stream_synchronize(std::ptr::null_mut()) }, "test", "sync").expect("sync");
            };
            run();
            let t0 = std::time::Instant::now();
            run();
            eprintln!(
                "dispatch_layout N={n} K={k} E={e} R={r}: {:.2} us/launch (back-to-back)",
                t0.elapsed().as_secs_f64() * 1e6 / iters as f64
            );
        }
    }
}
