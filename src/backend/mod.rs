//! Backends: one trait, one implementation per transport, chosen at buffer creation from the
//! device and `DEEP_EP_BACKEND`. A backend that is not compiled in answers with
//! [`Error::NotCompiled`]; a feature a backend lacks answers with [`Error::NotImplemented`].
//!
//! Argument structs are validated by `crate::ops` before a backend sees them: shapes, dtypes and
//! devices are already consistent, so backends only check what depends on their own state
//! (capacity, handle/buffer agreement).

pub mod cpu;
mod info;
pub mod internode;
pub mod low_latency;
pub mod normal;
#[cfg(feature = "nccl")]
pub mod peer;
pub mod registry;

#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
#[cfg(test)]
use crate::tensor::Device;
use crate::tensor::TensorRef;

pub use crate::tensor::Stream;
pub use info::{BackendKind, BufferInfo, CreateArgs};
pub use low_latency::*;
pub use normal::*;

/// A transport for one buffer: the three modes' traits and what every buffer has. Each backend
/// implements each mode in the file of that mode (`cpu/ht.rs`, `peer/normal.rs`, ...). Every
/// method is collective unless noted: all ranks of the buffer call it in the same order. CUDA
/// backends launch on `stream` and return without host sync unless noted; the CPU backend
/// completes before returning.
pub trait Backend: NormalMode + InternodeMode + LowLatencyMode + Send {
    /// Static facts of this buffer.
    fn info(&self) -> &BufferInfo;

    /// Releases the buffer (collective: barriers so no peer still reads it).
    fn destroy(&mut self) -> Result<()>;

    /// Per-peer host wait statistics since creation or the last reset, local: for each rank
    /// `p`, `[waits, nanoseconds]` = how many host-side waits of this rank included `p` and the
    /// total time spent until `p` arrived (the own row stays zero). Backends whose waits run on the GPU answer
    /// [`Error::NotImplemented`].
    fn wait_stats(&mut self, reset: bool) -> Result<Vec<[i64; 2]>>;

    /// This rank's part of the buffer as raw memory, local (DeepEP's `get_local_buffer_tensor`):
    /// the normal-mode (NVLink) part of `num_nvl_bytes` or, with `rdma`, the RDMA / low-latency
    /// part of `num_rdma_bytes`. The memory stays the buffer's: it is valid until the buffer is
    /// destroyed, and nothing keeps it beyond that. A part the backend does not hold answers
    /// [`Error::NotImplemented`].
    fn local_region(&mut self, rdma: bool) -> Result<LocalRegion>;
}

/// A backend's own memory handed out as a view ([`Backend::local_region`]): `bytes` bytes at
/// `ptr` on `device`, at least 128-byte aligned.
#[derive(Copy, Clone, Debug)]
pub struct LocalRegion {
    pub ptr: *mut u8,
    pub bytes: usize,
    pub device: crate::tensor::Device,
}

/// Normal mode (high-throughput) within one NVLink domain.
pub trait NormalMode {
    /// First half of a dispatch: exchange counts, learn output sizes (host sync unless
    /// `num_worst_tokens > 0`).
    fn dispatch_prepare(&mut self, args: &DispatchArgs) -> Result<DispatchPlan>;

    /// Second half: move tokens into the caller-allocated outputs.
    fn dispatch_finish(&mut self, args: &DispatchArgs, plan: &DispatchPlan, out: &DispatchOutputs) -> Result<()>;

    /// Dispatch with a handle from an earlier dispatch: `recv_x [rows, H]`, scales `[rows, S]`.
    fn cached_dispatch(&mut self, args: &CachedDispatchArgs, recv_x: &TensorRef, recv_x_scales: Option<&TensorRef>) -> Result<()>;

    /// Normal-mode combine (unweighted fp32 sum, ascending rank order, bias first).
    fn combine(&mut self, args: &CombineArgs, out: &CombineOutputs) -> Result<()>;
}

/// Normal mode across NVLink domains (DeepEP's internode mode).
pub trait InternodeMode {
    /// First half of an internode dispatch (ranks span several NVLink domains): output sizes.
    fn internode_dispatch_prepare(&mut self, args: &internode::InternodeDispatchArgs) -> Result<internode::InternodePlan>;

    /// Second half of an internode dispatch: tokens and the 10-tensor handle.
    fn internode_dispatch_finish(
        &mut self,
        args: &internode::InternodeDispatchArgs,
        plan: &internode::InternodePlan,
        out: &internode::InternodeDispatchOutputs,
    ) -> Result<()>;

    /// Internode dispatch reusing a handle: `recv_x [rows, H]`, scales `[rows, S]`.
    fn internode_cached_dispatch(
        &mut self,
        args: &internode::InternodeCachedDispatchArgs,
        recv_x: &TensorRef,
        recv_x_scales: Option<&TensorRef>,
    ) -> Result<()>;

    /// Internode combine (two-level reduction, see [`internode::InternodeCombineArgs`]).
    fn internode_combine(&mut self, args: &internode::InternodeCombineArgs, out: &CombineOutputs) -> Result<()>;
}

/// Low-latency mode (decode): two-phase dispatch and combine, rank masking.
pub trait LowLatencyMode {
    /// LL dispatch, send phase: cast and push tokens; writes `out.recv_state`.
    fn ll_dispatch_send(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        args: &LlDispatchSendArgs,
        out: &LlDispatchOutputs,
        stream: Stream,
    ) -> Result<()>;

    /// LL dispatch, recv phase: wait for every source and fill `out`.
    fn ll_dispatch_recv(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        out: &LlDispatchOutputs,
        stats: &LlStats,
        stream: Stream,
    ) -> Result<()>;

    /// A whole LL dispatch (send, then receive): `out.recv_state` may be left unwritten. Backends
    /// that can run both phases in one launch override this; the default runs the two phases.
    fn ll_dispatch(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        args: &LlDispatchSendArgs,
        out: &LlDispatchOutputs,
        stats: &LlStats,
        stream: Stream,
    ) -> Result<()> {
        ll_dispatch_in_two(self, g, o, args, out, stats, stream)
    }

    /// LL combine, send phase: push expert outputs back to their source ranks.
    fn ll_combine_send(&mut self, g: &LlGeometry, args: &LlCombineSendArgs, stream: Stream) -> Result<()>;

    /// LL combine, recv phase: wait and reduce Σ_k w_k·y_k in fp32 into `out`.
    fn ll_combine_recv(&mut self, g: &LlGeometry, args: &LlCombineRecvArgs, stats: &LlStats, stream: Stream) -> Result<()>;

    /// Backend-owned `[LL_STATE_LEN]` int64 on the buffer's device, contiguous: the `recv_state`
    /// of a whole LL dispatch (`combine` false) or combine (true) whose caller passed none, so
    /// that a whole op allocates nothing for a state its one launch does not use (its two-launch
    /// form passes it from the send to the receive). One per kind, reused by the next whole call
    /// of that kind in stream order; valid while the buffer lives.
    fn ll_own_state(&mut self, combine: bool) -> TensorRef;

    /// A whole LL combine (send, then receive): the `recv_state`s may be left unwritten. Backends
    /// that can run both phases in one launch override this; the default runs the two phases.
    fn ll_combine(
        &mut self,
        g: &LlGeometry,
        send: &LlCombineSendArgs,
        recv: &LlCombineRecvArgs,
        stats: &LlStats,
        stream: Stream,
    ) -> Result<()> {
        ll_combine_in_two(self, g, send, recv, stats, stream)
    }

    /// Local, not collective: writes `args.out` = `args.topk_idx` with the rows at or past the
    /// device scalar `args.num_tokens` set to −1 (not routed), so that one static-shape LL call
    /// (one captured CUDA graph) serves any real batch `n ≤ N`. CUDA backends launch on `stream`
    /// without host sync and clamp `n` to `0..=N` on the device (an out-of-range value cannot be
    /// reported without a sync); the CPU backend reads `n` and raises when it is out of range.
    fn ll_mask_rows(&mut self, op: &'static str, args: &LlRowsArgs, stream: Stream) -> Result<()>;

    /// Zeroes both halves' LL signal areas (barriers before and after).
    fn clean_low_latency_buffer(&mut self, g: &LlGeometry, stream: Stream) -> Result<()>;

    /// The send buffer the next LL combine reads with `zero_copy` (not collective): a bf16
    /// view `[E_l, R*T, H]` with strides `(R*T*M, M, 1)`, `M = H + H/128*2`.
    fn next_low_latency_combine_buffer(&mut self, g: &LlGeometry) -> Result<TensorRef>;

    /// Rank masking of low-latency mode (DeepEP's `low_latency_update_mask_buffer`), local:
    /// marks `rank` (already range-checked) dead (`masked`) or alive. LL ops of this rank then
    /// neither send to nor wait for a masked rank, and the experts it owns are dropped: tokens
    /// routed to them are not sent and contribute zero to the combine. Takes effect at the next
    /// LL op (on CUDA: at the next kernel launch or graph replay, the mask lives in host-mapped
    /// memory). Normal-mode ops ignore the mask.
    fn ll_update_mask(&mut self, rank: usize, masked: bool) -> Result<()>;

    /// The mask of every rank (`true` = masked), local.
    fn ll_mask(&self) -> Vec<bool>;

    /// Unmasks every rank (DeepEP's `low_latency_clean_mask_buffer`), local.
    fn ll_clean_mask(&mut self) -> Result<()>;

    /// Shrink mode (DeepEP's `enable_shrink`), local: when on, an LL wait (or an LL barrier)
    /// that times out masks the ranks that did not arrive and goes on instead of raising.
    fn ll_set_shrink(&mut self, enable: bool) -> Result<()>;
}

/// A whole LL dispatch as its two phases (send, then receive), through the backend's own
/// `recv_state` when the caller passed none: [`LowLatencyMode::ll_dispatch`]'s default, and the
/// fallback of a backend that overrides it.
pub fn ll_dispatch_in_two<B: LowLatencyMode + ?Sized>(
    b: &mut B,
    g: &LlGeometry,
    o: &LlDispatchOptions,
    args: &LlDispatchSendArgs,
    out: &LlDispatchOutputs,
    stats: &LlStats,
    stream: Stream,
) -> Result<()> {
    let out = &LlDispatchOutputs { recv_state: out.recv_state.or_else(|| Some(b.ll_own_state(false))), ..*out };
    b.ll_dispatch_send(g, o, args, out, stream)?;
    b.ll_dispatch_recv(g, o, out, stats, stream)
}

/// The one `recv_state` that carries a whole LL combine's send to its receive when it runs as two
/// launches: the caller's, else the backend's own.
pub fn ll_combine_state<B: LowLatencyMode + ?Sized>(b: &mut B, send: &LlCombineSendArgs, recv: &LlCombineRecvArgs) -> Option<TensorRef> {
    send.recv_state.or(recv.recv_state).or_else(|| Some(b.ll_own_state(true)))
}

/// A whole LL combine as its two phases, through [`ll_combine_state`]:
/// [`LowLatencyMode::ll_combine`]'s default.
pub fn ll_combine_in_two<B: LowLatencyMode + ?Sized>(
    b: &mut B,
    g: &LlGeometry,
    send: &LlCombineSendArgs,
    recv: &LlCombineRecvArgs,
    stats: &LlStats,
    stream: Stream,
) -> Result<()> {
    let state = ll_combine_state(b, send, recv);
    b.ll_combine_send(g, &LlCombineSendArgs { recv_state: state, ..*send }, stream)?;
    b.ll_combine_recv(g, &LlCombineRecvArgs { recv_state: state, ..*recv }, stats, stream)
}

pub use crate::config::UNIQUE_ID_BYTES;

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(requested: &str, env: &str, device: Device) -> std::result::Result<&'static str, String> {
        BackendKind::select_from("op", requested, env, device).map(BackendKind::name).map_err(|e| e.to_string())
    }

    #[test]
    fn selection_by_argument_then_environment_then_device() {
        let gpu = Device::Cuda(0);
        assert_eq!(sel("", "", gpu), Ok("nccl"));
        assert_eq!(sel("", "", Device::Cpu), Ok("cpu"));
        assert_eq!(sel("", "nvshmem", gpu), Ok("nvshmem"));
        assert_eq!(sel("nccl", "nvshmem", gpu), Ok("nccl"));
        assert_eq!(sel("nvshmem", "", gpu), Ok("nvshmem"));
        // The variable is only a preference for GPU buffers; an explicit request must be honoured.
        assert_eq!(sel("", "nvshmem", Device::Cpu), Ok("cpu"));
        let e = sel("nvshmem", "", Device::Cpu).unwrap_err();
        assert_eq!(e, "op: backend 'nvshmem' needs a CUDA device; CPU buffers use the cpu backend");
        let e = sel("", "shmem", gpu).unwrap_err();
        assert!(e.contains("unknown backend 'shmem' (from DEEP_EP_BACKEND) (expected cpu, nccl, nvshmem or ipc)"), "{e}");
    }

    #[test]
    fn nvshmem_backend_is_compiled_or_says_which_feature() {
        let args = CreateArgs {
            unique_id: &[0u8; 128],
            rank: 0,
            num_ranks: 2,
            device: Device::Cpu,
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: false,
        };
        let e = registry::create(BackendKind::Nvshmem, &args).err().map(|e| e.to_string()).unwrap_or_default();
        if cfg!(feature = "nvshmem") {
            assert!(e.contains("the nvshmem backend needs a CUDA device, got cpu"), "{e}");
        } else {
            assert!(e.contains("backend 'nvshmem' is not compiled into this library (cargo feature 'nvshmem')"), "{e}");
        }
    }

    #[test]
    fn the_latest_dispatch_with_an_address_decides_partial_combines() {
        let rec: [LlDispatchRecord; 2] = [Some((0x1000, true, 1)), Some((0x2000, false, 2))];
        assert_eq!(ll_weighted_dispatch_half(&rec, 0x1000), Some(0));
        assert_eq!(ll_weighted_dispatch_half(&rec, 0x2000), None);
        assert_eq!(ll_weighted_dispatch_half(&rec, 0x3000), None);
        // A freed src_info address reused by a later unweighted dispatch: no partial sums.
        let reused: [LlDispatchRecord; 2] = [Some((0x1000, true, 1)), Some((0x1000, false, 2))];
        assert_eq!(ll_weighted_dispatch_half(&reused, 0x1000), None);
        let both: [LlDispatchRecord; 2] = [Some((0x1000, true, 3)), Some((0x1000, false, 2))];
        assert_eq!(ll_weighted_dispatch_half(&both, 0x1000), Some(0));
    }

    #[test]
    fn wire_layout_fits_deepeps_receive_half() {
        let g = |t, h, e| LlGeometry { num_max_dispatch_tokens_per_rank: t, hidden: h, num_experts: e };
        // DeepEP's shape: message stride 160 + 2 * 7168 (an FP8 message writes 160 + 7168 + 224
        // of it), partial rows after them.
        let w = g(128, 7168, 288).wire(4).unwrap();
        assert_eq!((w.idx_off, w.msg_bytes), (128, 14_496));
        assert_eq!(w.msgs_off, 128 + 4 * 288 * 128);
        assert!(w.partial_fits && w.partial_off >= w.msgs_off + 4 * 128 * w.msg_bytes && w.partial_off % 128 == 0);
        // Small hidden: one expert per rank leaves no room for the messages, two no room for
        // the partial rows (the combine then sends per-expert rows); at 7168 one expert fits.
        assert!(g(128, 128, 8).wire(8).is_none());
        // One expert per rank: below hidden 7168 the messages never fit, from 7168 they always do
        // (the LL GPU suite's configuration generator skips the former).
        assert!(g(1, 5120, 16).wire(16).is_none() && g(1500, 5120, 16).wire(16).is_none());
        assert!(g(1, 7168, 16).wire(16).is_some() && g(1500, 8192, 16).wire(16).is_some());
        assert!(!g(128, 128, 16).wire(8).unwrap().partial_fits);
        assert!(!g(128, 7168, 8).wire(8).unwrap().partial_fits);
        assert!(g(128, 7168, 24).wire(8).unwrap().partial_fits);
    }
}
