//! Bindings of the remote-peer transport's C API (`kernels/transport_api.h`, device code in
//! `kernels/transport.cuh`): descriptor structs, GIN device-comm creation, and the transport
//! self-test launches. The structs and declarations are generated from the header
//! (`crate::sys::kernels`); [`check_struct_sizes`] still compares them with the kernels'
//! `sizeof` at run time (a stale build).

use crate::error::{Error, Result};
use crate::sys::kernels::*;
use std::ffi::{c_int, c_void};

/// Ranks the LSA emulation can address (`DEK_TP_MAX_LSA_PEERS`).
pub const MAX_LSA_PEERS: usize = DEK_TP_MAX_LSA_PEERS as usize;
/// GIN contexts per communicator (`DEK_TP_MAX_GIN_CONTEXTS` = NCCL's `NCCL_GIN_MAX_CONTEXTS`).
pub const MAX_GIN_CONTEXTS: usize = DEK_TP_MAX_GIN_CONTEXTS as usize;

/// Codes of [`Status::error`].
pub mod err {
    /// A signal did not reach its target before the deadline.
    pub const TIMEOUT: i32 = crate::sys::kernels::DEK_TP_ERR_TIMEOUT as i32;
    /// Self-test: received bytes differ from the sender's pattern.
    pub const DATA: i32 = crate::sys::kernels::DEK_TP_ERR_DATA as i32;
}

/// `dek_tp_status_t`: host-mapped error record of a transport kernel (first error wins;
/// `error` is written last): [`err`] code (0 = none), the world rank waited for or that sent bad
/// data, signal id, context, the last value seen (or first bad word) and the value waited for.
pub type Status = dek_tp_status_t;
/// `dek_tp_lsa_t`: the LSA emulation's view of the emulated world (one NVLink domain).
pub type LsaDesc = dek_tp_lsa_t;
/// `dek_tp_gin_reqs_t`: what `ncclDevCommCreate` is asked for.
pub type GinReqs = dek_tp_gin_reqs_t;
/// `dek_tp_gin_info_t`: what the created device comm offers (`gin_type`: `ncclNetDeviceType`
/// of context 0, 2 proxy, 3 GDAKI; `gin_context_count` 0 = no GIN).
pub type GinInfo = dek_tp_gin_info_t;
/// `dek_tp_ping_t`: arguments of the transport self-test (see the header).
pub type PingArgs = dek_tp_ping_t;
/// `dek_tp_nvshmem_t`: the NVSHMEM transport's view of the world (PE = world rank).
pub type NvshmemDesc = dek_tp_nvshmem_t;

/// Fails when a Rust mirror's size differs from the C struct's (header and this file out of step).
pub fn check_struct_sizes(op: &'static str) -> Result<()> {
    // SAFETY: pure queries of compile-time constants (the index order is the header's).
    let c = |i: c_int| unsafe { dek_tp_struct_size(i) };
    super::check_struct_size::<Status>(op, "dek_tp_status_t", c(0))?;
    super::check_struct_size::<LsaDesc>(op, "dek_tp_lsa_t", c(1))?;
    super::check_struct_size::<GinReqs>(op, "dek_tp_gin_reqs_t", c(2))?;
    super::check_struct_size::<GinInfo>(op, "dek_tp_gin_info_t", c(3))?;
    super::check_struct_size::<PingArgs>(op, "dek_tp_ping_t", c(4))?;
    super::check_struct_size::<NvshmemDesc>(op, "dek_tp_nvshmem_t", c(5))
}

/// Launches the self-test over the LSA emulation (one warp) on `stream`. Asynchronous; the
/// result lands in `args.status`. Every rank of the rail team must launch it with the same
/// `seq`, `bytes`, offsets and signal.
///
/// # Safety
/// `lsa.peer_base` must hold live windows of `window_bytes`, `args.status` host-mapped memory and
/// `args.claim` a device word, all alive until the kernel finished; `stream` a valid stream or null.
pub unsafe fn ping_lsa(op: &'static str, lsa: &LsaDesc, args: &PingArgs, stream: *mut c_void) -> Result<()> {
    crate::kernels::layout::check(dek_tp_ping_lsa(lsa, args, stream), op, "launching the LSA transport self-test")
}

/// Launches the self-test over NCCL GIN (one warp) on `stream`.
///
/// # Safety
/// `devcomm` must be a device comm from [`gin_devcomm_create`] whose communicator is alive,
/// `window` a window registered on it holding the offsets of `args`; as [`ping_lsa`] otherwise.
pub unsafe fn ping_gin(op: &'static str, devcomm: &[u64], window: *mut c_void, args: &PingArgs, stream: *mut c_void) -> Result<()> {
    let st = dek_tp_ping_gin(devcomm.as_ptr().cast(), devcomm.len() * 8, window, args, stream);
    crate::kernels::layout::check(st, op, "launching the GIN transport self-test")
}

/// `ncclDevCommCreate` with GIN requirements: returns the device comm (an 8-aligned byte copy of
/// `ncclDevComm`, to pass to kernels) and what NCCL granted. A failed call returns the NCCL result
/// code as `Err(code)` so the caller can word the error (see `backend::peer::gin`).
///
/// # Safety
/// `create_fn` must be `ncclDevCommCreate` of the loaded NCCL and `comm` a live communicator of it.
pub unsafe fn gin_devcomm_create(create_fn: *mut c_void, comm: *mut c_void, reqs: &GinReqs) -> GinGrant {
    let bytes = dek_nccl_devcomm_bytes();
    let mut devcomm = vec![0u64; bytes.div_ceil(8)];
    let mut info = GinInfo::default();
    let res = dek_tp_gin_devcomm_create(create_fn, comm, reqs, devcomm.as_mut_ptr().cast(), devcomm.len() * 8, &mut info);
    if res == 0 {
        Ok((devcomm, info))
    } else {
        Err(res)
    }
}

/// What [`gin_devcomm_create`] returns: the device comm and the grant, or the NCCL result code.
pub type GinGrant = std::result::Result<(Vec<u64>, GinInfo), i32>;

/// Wraps an NCCL result of [`gin_devcomm_create`] that is not a device error of ours.
pub fn devcomm_error(op: &'static str, code: i32, detail: String) -> Error {
    Error::Device { op, what: "ncclDevCommCreate (GIN)".into(), detail: format!("ncclResult_t {code}: {detail}") }
}

/// Writes this rank's LSA emulation descriptor (`dek_tp_lsa_t`: every rank's window base
/// from `bases`, the window's LSA pointers, not `ctx.peer_base`, which holds the own NVLink domain
/// only; `num_contexts` signal tables of `num_signals` at `signal_off`) into its own window at
/// `desc_off`, synchronously. The LL kernels of an internode buffer and the global barrier read it
/// there (`LsaNet` of `kernels/transport.cuh`). Fails, naming the transport switch, when a rank's
/// window is not addressable (a real cluster). Local (no peer involved).
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: `ctx` a live window of this rank (and
/// pointer arguments null or live and large enough until the work ran).
pub unsafe fn write_lsa_desc(
    op: &'static str,
    ctx: &crate::kernels::intranode::Ctx,
    bases: &[*mut c_void],
    desc_off: usize,
    signal_off: usize,
    num_contexts: usize,
    num_signals: usize,
) -> Result<()> {
    let n = ctx.num_ranks as usize;
    crate::ensure!(bases.len() >= n, op, "internal: {} window bases for {n} ranks", bases.len());
    if let Some(p) = (0..n).find(|&p| bases[p].is_null()) {
        return Err(crate::error::Error::invalid(op, format!(
            "the LSA emulation of the RDMA leg (DEEP_EP_RDMA_TRANSPORT unset or lsa) needs every rank's window over NVLink, but rank {} cannot address rank {p}'s: on several machines set DEEP_EP_RDMA_TRANSPORT=gin",
            ctx.rank
        )));
    }
    let end = (signal_off + 8 * num_contexts * num_signals) as u64;
    crate::ensure!(
        n <= MAX_LSA_PEERS && (1..=MAX_GIN_CONTEXTS).contains(&num_contexts) && signal_off % 8 == 0 && desc_off % 16 == 0,
        op,
        "internal: LSA descriptor for {n} ranks, {num_contexts} contexts"
    );
    crate::ensure!(
        ((desc_off + std::mem::size_of::<LsaDesc>()) as u64) <= ctx.window_bytes && end <= ctx.window_bytes,
        op,
        "internal: seam area outside the window of {} bytes",
        ctx.window_bytes
    );
    let mut lsa = LsaDesc {
        peer_base: [std::ptr::null_mut(); MAX_LSA_PEERS],
        rank: ctx.rank,
        num_ranks: ctx.num_ranks,
        num_contexts: num_contexts as i32,
        num_signals: num_signals as i32,
        signal_off: signal_off as u64,
        window_bytes: ctx.window_bytes,
    };
    lsa.peer_base[..n].copy_from_slice(&bases[..n]);
    let own = ctx.own_base();
    // SAFETY: size_of::<LsaDesc>() bytes inside this rank's own live window (checked above), from
    // a host struct that lives through the synchronous copy.
    let st = unsafe {
        dek_cuda_memcpy_htod(own.cast::<u8>().add(desc_off).cast(), (&lsa as *const LsaDesc).cast(), std::mem::size_of::<LsaDesc>())
    };
    crate::kernels::layout::check(st, op, "writing an LSA seam descriptor")
}

/// Layout of the GIN seam descriptor (`GinNet` of `kernels/transport.cuh`: `MAX_GIN_COMMS` pairs of
/// an `ncclDevComm` by value and the window's `ncclWindow_t` on that communicator, then the count of
/// communicators and the contexts used per communicator), as the compiler lays it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GinNetLayout {
    /// `sizeof(GinNet)`.
    pub bytes: usize,
    /// `alignof(GinNet)`.
    pub align: usize,
    /// Byte offset of the first communicator's window handle.
    pub win_off: usize,
    /// Bytes from one communicator's pair to the next (`sizeof(GinComm)`).
    pub stride: usize,
    /// Byte offset of `num_comms` (i32).
    pub comms_off: usize,
    /// Byte offset of `num_contexts` (i32).
    pub contexts_off: usize,
    /// Communicators the descriptor holds at most (`DEK_TP_MAX_GIN_COMMS`).
    pub capacity: usize,
}

/// The layout of `GinNet` (pure queries of compile-time constants).
pub fn gin_net_layout() -> GinNetLayout {
    // SAFETY: pure queries.
    let q = |w: c_int| unsafe { dek_ll_gin_net_layout(w) };
    GinNetLayout { bytes: q(0), align: q(1), win_off: q(2), stride: q(3), comms_off: q(4), contexts_off: q(5), capacity: q(6) }
}

/// The (communicator, context) the device routes unit `unit` to among `comms` x `contexts`
/// (`gin_route` of `kernels/transport.cuh`), for checking the host's route against it. Pure.
pub fn device_gin_route(unit: usize, comms: usize, contexts: usize) -> (usize, usize) {
    let (mut k, mut c): (c_int, c_int) = (-1, -1);
    // SAFETY: pure arithmetic writing two ints.
    unsafe { dek_ll_gin_route(unit as c_int, comms as c_int, contexts as c_int, &mut k, &mut c) };
    (k as usize, c as usize)
}

/// Builds the GIN seam descriptor on the host from the buffer's GIN communicators: per
/// communicator, a device comm from [`gin_devcomm_create`] that NCCL granted GIN and the handle of
/// the window registered on that communicator (the buffer's first communicator first). Fails when
/// the descriptor would not fit the `desc_bytes` reserved for it, needs more than 8-byte alignment
/// (the host copy is a `u64` buffer; the window slot is 128-aligned), or a communicator is missing
/// its window or GIN.
pub fn build_gin_net(op: &'static str, comms: &[(&[u64], *mut c_void)], desc_bytes: usize) -> Result<Vec<u64>> {
    let l = gin_net_layout();
    crate::ensure!(
        l.bytes > 0 && l.bytes <= desc_bytes && l.align <= 8,
        op,
        "internal: the GIN seam descriptor is {} bytes (align {}), {desc_bytes} reserved",
        l.bytes,
        l.align
    );
    crate::ensure!(
        (1..=l.capacity).contains(&comms.len()),
        op,
        "internal: GIN seam descriptor for {} communicators (1..={})",
        comms.len(),
        l.capacity
    );
    crate::ensure!(comms.iter().all(|(_, w)| !w.is_null()), op, "internal: GIN seam descriptor without a window");
    let dc_bytes = comms.iter().map(|(d, _)| d.len() * 8).min().unwrap_or(0);
    let devcomms: Vec<*const c_void> = comms.iter().map(|(d, _)| d.as_ptr().cast()).collect();
    let windows: Vec<*mut c_void> = comms.iter().map(|(_, w)| *w).collect();
    let mut out = vec![0u64; l.bytes.div_ceil(8)];
    // SAFETY: reads dc_bytes (the shortest slice) from each device comm and one handle per window,
    // writes at most out.len() * 8 bytes of our 8-aligned buffer (the glue checks both sizes and
    // the alignment).
    let n = unsafe {
        dek_ll_gin_net_build(devcomms.as_ptr(), dc_bytes, windows.as_ptr(), comms.len() as c_int, out.as_mut_ptr().cast(), out.len() * 8)
    };
    crate::ensure!(
        n == l.bytes,
        op,
        "internal: building the GIN seam descriptor from {} device comm(s) of {dc_bytes} bytes failed",
        comms.len()
    );
    Ok(out)
}

/// Writes this rank's GIN seam descriptor ([`build_gin_net`] of `comms`) into its own window at
/// `desc_off`, synchronously; the LL and normal-mode kernels of an internode buffer over GIN and
/// its global barrier read it there (`net` with `net_kind` GIN). Local (no peer involved).
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: `ctx` a live window of this rank (and
/// pointer arguments null or live and large enough until the work ran).
pub unsafe fn write_gin_desc(
    op: &'static str,
    ctx: &crate::kernels::intranode::Ctx,
    desc_off: usize,
    desc_bytes: usize,
    comms: &[(&[u64], *mut c_void)],
) -> Result<()> {
    let desc = build_gin_net(op, comms, desc_bytes)?;
    let bytes = gin_net_layout().bytes;
    crate::ensure!(
        desc_off % 16 == 0 && ((desc_off + desc_bytes) as u64) <= ctx.window_bytes,
        op,
        "internal: GIN seam descriptor at {desc_off} outside the window of {} bytes",
        ctx.window_bytes
    );
    let own = ctx.own_base();
    // SAFETY: `bytes` <= desc_bytes inside this rank's own live window (checked above), from a host
    // buffer that lives through the synchronous copy.
    let st = unsafe { dek_cuda_memcpy_htod(own.cast::<u8>().add(desc_off).cast(), desc.as_ptr().cast(), bytes) };
    crate::kernels::layout::check(st, op, "writing a GIN seam descriptor")
}

/// Writes `info` into a zeroed `ncclDevComm` at `out`, as NCCL fills a grant: for stand-ins of
/// `ncclDevCommCreate` in tests without a NIC. Returns -1 on bad arguments.
///
/// # Safety
/// `out` must be writable for [`devcomm_bytes`] bytes.
#[cfg(test)]
pub unsafe fn devcomm_fill(out: *mut c_void, info: &GinInfo) -> i32 {
    dek_tp_devcomm_fill(out, devcomm_bytes(), info)
}

/// `sizeof(ncclDevComm)` of the build's NCCL headers.
pub fn devcomm_bytes() -> usize {
    // SAFETY: pure query.
    unsafe { dek_nccl_devcomm_bytes() }
}

// ---- LSA self-test on a live intranode window ------------------------------------------------
// Layout, right after the control area (the data area is unused while a buffer is created):
// signal table (one context, one signal per sender), the own staging block, then one receive
// block per rail-team member.
const ST_SIGNALS_OFF: u64 = crate::kernels::intranode::CONTROL_BYTES as u64;
const ST_BYTES: u64 = 16 << 10;
const ST_SRC_OFF: u64 = ST_SIGNALS_OFF + 4096;
const ST_DST_OFF: u64 = ST_SRC_OFF + ST_BYTES;

/// Window bytes the LSA self-test needs for `num_ranks` ranks.
pub fn lsa_self_test_bytes(num_ranks: usize) -> u64 {
    ST_DST_OFF + ST_BYTES * num_ranks as u64
}

/// The LSA self-test: one round of the ping over the LSA transport between the ranks of each rail
/// (`rail_stride` = ranks per emulated node; 1 = all ranks), synchronous on `stream`. Collective.
/// Every rank's signal table must be zero before any rank starts: buffer creation zeroes the
/// whole window and meets at a host rendezvous before calling this.
/// A silent peer raises [`Error::Timeout`] naming it; corrupted data an [`Error::Device`].
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: `ctx` a live window of this rank (and
/// pointer arguments null or live and large enough until the work ran).
pub unsafe fn lsa_self_test_run(
    op: &'static str,
    ctx: &crate::kernels::intranode::Ctx,
    rail_stride: usize,
    timeout_ns: u64,
    stream: *mut c_void,
) -> Result<()> {
    crate::ensure!(
        ctx.window_bytes >= lsa_self_test_bytes(ctx.num_ranks as usize),
        op,
        "internal: window of {} bytes too small for the transport self-test",
        ctx.window_bytes
    );
    let n = ctx.num_ranks as usize;
    // Its windows come from a Ctx of every rank, and its area (before the internode control area)
    // holds a receive slot per rank: at most 8 ranks.
    crate::ensure!(
        n <= crate::kernels::intranode::MAX_RANKS,
        op,
        "DEEP_EP_TRANSPORT_SELFTEST runs on buffers of at most {} ranks, not {n}: unset it",
        crate::kernels::intranode::MAX_RANKS
    );
    crate::ensure!(
        rail_stride >= 1 && n % rail_stride == 0 && n <= MAX_LSA_PEERS,
        op,
        "internal: self-test rail stride {rail_stride} for {n} ranks"
    );
    let mut lsa = LsaDesc {
        peer_base: [std::ptr::null_mut(); MAX_LSA_PEERS],
        rank: ctx.rank,
        num_ranks: ctx.num_ranks,
        num_contexts: 1,
        num_signals: MAX_LSA_PEERS as i32,
        signal_off: ST_SIGNALS_OFF,
        window_bytes: ctx.window_bytes,
    };
    lsa.peer_base[..n].copy_from_slice(&ctx.peer_base[..n]);
    let args = PingArgs {
        rank: ctx.rank,
        num_ranks: ctx.num_ranks,
        rail_stride: rail_stride as i32,
        context: 0,
        signal: 0,
        seq: 1,
        bytes: ST_BYTES,
        src_off: ST_SRC_OFF,
        dst_off: ST_DST_OFF,
        expect: 1,
        timeout_ns,
        status: std::ptr::null_mut(),
        claim: std::ptr::null_mut(),
    };
    // SAFETY: the windows outlive the kernel (ping_round synchronises the stream).
    ping_round(op, args, stream, "the LSA emulation", |a| unsafe { ping_lsa(op, &lsa, a, stream) })
}

/// One self-test round: `args` completed with a fresh host-mapped status and claim word,
/// launched by `launch`, the stream synchronised, the status turned into the error it reports.
fn ping_round(
    op: &'static str,
    mut args: PingArgs,
    stream: *mut c_void,
    over: &str,
    launch: impl FnOnce(&PingArgs) -> Result<()>,
) -> Result<()> {
    let mapped = MappedStatus::new(op)?;
    let mut claim: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one device pointer; freed below on every path.
    crate::kernels::layout::check(unsafe { dek_cuda_malloc(&mut claim, 4) }, op, "cudaMalloc (self-test claim word)")?;
    let result = (|| {
        // SAFETY: 4 bytes of the allocation above.
        crate::kernels::layout::check(unsafe { dek_cuda_memset_async(claim, 0, 4, stream) }, op, "cudaMemsetAsync")?;
        args.status = mapped.device.cast();
        args.claim = claim.cast();
        // The mapped status and the claim word outlive the kernel (the stream is synchronised
        // before they are released).
        launch(&args)?;
        // SAFETY: a valid stream (or null) from the caller.
        crate::kernels::layout::check(unsafe { dek_cuda_stream_synchronize(stream) }, op, "synchronising the transport self-test")
    })();
    // SAFETY: allocated above; the stream is synchronised or the launch failed.
    unsafe { dek_cuda_free(claim) };
    result?;
    let s = mapped.read();
    match s.error {
        0 => Ok(()),
        err::TIMEOUT => Err(Error::Timeout {
            op,
            rank: args.rank as usize,
            peers: vec![s.peer.max(0) as usize],
            timeout_ms: args.timeout_ns / 1_000_000,
            what: format!("transport self-test over {over} (signal {} at {} of {})", s.signal, s.seen, s.expected),
        }),
        code => Err(Error::Device {
            op,
            what: format!("transport self-test over {over}"),
            detail: format!("error {code}: data from rank {} reads {:#x} where {:#x} was sent", s.peer, s.seen, s.expected),
        }),
    }
}

// ---- NVSHMEM transport (kernels/nvshmem/transport.cu) -----------------------------------------

/// Whether this build carries the NVSHMEM device transport (feature `nvshmem` with NVSHMEM's
/// headers and `libnvshmem_device.a` found at build time).
pub const NVSHMEM_DEVICE_BUILT: bool = cfg!(deep_ep_nvshmem_device);

/// What a build without the NVSHMEM device transport is missing (its `NotImplemented` feature).
#[cfg(not(deep_ep_nvshmem_device))]
const NO_NVSHMEM_DEVICE: &str = "the NVSHMEM device transport (built without NVSHMEM's device library: set NVSHMEM_HOME and rebuild)";

/// Window bytes the NVSHMEM self-test needs for `num_ranks` ranks: the LSA test's areas plus a
/// receive area of its own (a rank may start it while a peer still checks the LSA round).
pub fn nvshmem_self_test_bytes(num_ranks: usize) -> u64 {
    lsa_self_test_bytes(num_ranks) + ST_BYTES * num_ranks as u64
}

/// Hands this library's NVSHMEM device state to the initialised host library
/// (`nvshmemx_cumodule_init` / `nvshmemx_cumodule_finalize` resolved from it, passed as `func`).
/// `init` false = unregister. Errors when the build has no NVSHMEM device transport.
///
/// # Safety
/// `func` must be the named function of the NVSHMEM host library that was initialised in this
/// process, on the current device.
pub unsafe fn nvshmem_device_register(op: &'static str, func: *mut c_void, init: bool) -> Result<()> {
    #[cfg(deep_ep_nvshmem_device)]
    {
        let st = if init { dek_tp_nvshmem_device_init(func) } else { dek_tp_nvshmem_device_fini(func) };
        let name = if init { "nvshmemx_cumodule_init" } else { "nvshmemx_cumodule_finalize" };
        match st {
            0 => Ok(()),
            s if s >= 1000 => Err(Error::Device {
                op,
                what: format!("{name}: finding this library's CUDA module"),
                detail: crate::kernels::layout::cuda_error_text(s - 1000),
            }),
            s => Err(Error::Device {
                op,
                what: format!("{name} (registering the NVSHMEM device state)"),
                detail: format!("NVSHMEM status {s}"),
            }),
        }
    }
    #[cfg(not(deep_ep_nvshmem_device))]
    {
        let _ = (func, init);
        Err(Error::NotImplemented { op, backend: "nvshmem", feature: NO_NVSHMEM_DEVICE })
    }
}

/// The NVSHMEM self-test: one round of the ping over the NVSHMEM transport (puts with
/// NVSHMEM_SIGNAL_ADD into the peers' symmetric signal table, context 1) between the ranks of
/// each rail, synchronous on `stream`; run after [`lsa_self_test_run`] on the same window (own
/// signal context and receive area). `base` is the window's symmetric address. Collective.
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: `ctx` a live window of this rank (and
/// pointer arguments null or live and large enough until the work ran).
pub unsafe fn nvshmem_self_test_run(
    op: &'static str,
    ctx: &crate::kernels::intranode::Ctx,
    base: *mut c_void,
    rail_stride: usize,
    timeout_ns: u64,
    stream: *mut c_void,
) -> Result<()> {
    let n = ctx.num_ranks as usize;
    crate::ensure!(
        ctx.window_bytes >= nvshmem_self_test_bytes(n),
        op,
        "internal: window of {} bytes too small for the NVSHMEM transport self-test",
        ctx.window_bytes
    );
    crate::ensure!(rail_stride >= 1 && n % rail_stride == 0, op, "internal: self-test rail stride {rail_stride} for {n} ranks");
    let net = NvshmemDesc {
        base,
        rank: ctx.rank,
        num_ranks: ctx.num_ranks,
        num_contexts: 2,
        num_signals: MAX_LSA_PEERS as i32,
        signal_off: ST_SIGNALS_OFF,
        window_bytes: ctx.window_bytes,
    };
    let dst_off = ST_DST_OFF + ST_BYTES * n as u64;
    let args = PingArgs {
        rank: ctx.rank,
        num_ranks: ctx.num_ranks,
        rail_stride: rail_stride as i32,
        context: 1,
        signal: 0,
        seq: 2,
        bytes: ST_BYTES,
        src_off: ST_SRC_OFF,
        dst_off,
        expect: 1,
        timeout_ns,
        status: std::ptr::null_mut(),
        claim: std::ptr::null_mut(),
    };
    ping_round(op, args, stream, "NVSHMEM", |a| ping_nvshmem(op, &net, a, stream))
}

/// Launches the self-test over NVSHMEM (one warp) on `stream`; the caller synchronises.
#[cfg(deep_ep_nvshmem_device)]
fn ping_nvshmem(op: &'static str, net: &NvshmemDesc, args: &PingArgs, stream: *mut c_void) -> Result<()> {
    // SAFETY: `net.base` is the live symmetric window and the device state is registered
    // (nvshmem_device_register, at NVSHMEM's initialisation); `args`' status and claim outlive
    // the kernel (ping_round).
    crate::kernels::layout::check(unsafe { dek_tp_ping_nvshmem(net, args, stream) }, op, "launching the NVSHMEM transport self-test")
}

#[cfg(not(deep_ep_nvshmem_device))]
fn ping_nvshmem(op: &'static str, _: &NvshmemDesc, _: &PingArgs, _: *mut c_void) -> Result<()> {
    Err(Error::NotImplemented { op, backend: "nvshmem", feature: NO_NVSHMEM_DEVICE })
}

/// A host-mapped [`Status`], zeroed, freed on drop.
struct MappedStatus {
    host: *mut Status,
    device: *mut c_void,
}

impl MappedStatus {
    fn new(op: &'static str) -> Result<MappedStatus> {
        let (mut host, mut device) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: writes two pointers to a pinned mapped allocation of the given size.
        crate::kernels::layout::check(
            unsafe { dek_cuda_host_alloc_mapped(&mut host, &mut device, std::mem::size_of::<Status>()) },
            op,
            "cudaHostAlloc(mapped)",
        )?;
        let m = MappedStatus { host: host.cast(), device };
        // SAFETY: the allocation is ours, aligned and large enough.
        unsafe { m.host.write_volatile(Status::default()) };
        Ok(m)
    }

    fn read(&self) -> Status {
        // SAFETY: live, aligned; the kernel that wrote it has finished (stream synchronised).
        unsafe { self.host.read_volatile() }
    }
}

impl Drop for MappedStatus {
    fn drop(&mut self) {
        // SAFETY: allocated by cudaHostAlloc in `new`, freed once.
        unsafe { dek_cuda_free_host(self.host.cast()) };
    }
}

#[cfg(test)]
mod tests;
