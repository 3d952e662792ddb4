//! The barrier of every rank of an internode buffer whose kernels address only the windows of
//! their own NVLink domain ([`Ctx::nvl_ranks`] > 0): `kernels/global_barrier.cu`, protocol and
//! window area in `kernels/deep_ep_kernels.h` ("Global barrier of an internode buffer"). A node
//! phase over NVLink, then a seam phase between rail peers through the transport seam (the LSA
//! emulation or NCCL GIN) whose descriptor lies in the barrier's area of each rank's window,
//! written at creation by [`setup_lsa`] / [`setup_gin`]. [`all_ranks`] is the barrier of every
//! rank for any buffer (`destroy_buffer`, the low-latency signal reset): this one for a split
//! ctx, the intranode flag barrier otherwise.

use crate::error::Result;
use crate::kernels::intranode::{self, device_synchronize, err, site, Ctx, HostStatus, Stream, SyncArgs, CONTROL_BYTES};
use crate::kernels::layout::check;
use crate::kernels::low_latency::{NET_GIN, NET_LSA};
use crate::sys::kernels::*;
use std::ffi::c_void;

/// The barrier's area in the control area of every window (`DEK_GB_OFF`).
pub const AREA_OFF: usize = DEK_GB_OFF as usize;
/// The LSA emulation's signal table of the barrier (`DEK_GB_SIG_OFF`).
pub const SIGNAL_OFF: usize = DEK_GB_SIG_OFF as usize;
/// The seam descriptor (`DEK_GB_DESC_OFF`, `DEK_GB_DESC_BYTES`).
pub const DESC_OFF: usize = DEK_GB_DESC_OFF as usize;
pub const DESC_BYTES: usize = DEK_GB_DESC_BYTES as usize;
/// Signal ids the barrier uses from its base: one per source NVLink domain
/// (`DEK_GB_MAX_DOMAINS`); on GIN they come after the ops' ids
/// (`backend::peer::signals::barrier_base`).
pub const SIGNALS: usize = DEK_GB_MAX_DOMAINS as usize;

/// `dek_gb_header_t`.
type Header = dek_gb_header_t;

/// Fails when the constants differ from the kernels' (a stale build).
pub fn check_layout(op: &'static str) -> Result<()> {
    // SAFETY: pure queries of compile-time constants.
    let got: Vec<usize> = (0..4).chain([6]).map(|w| unsafe { dek_gb_layout(w) }).collect();
    let want = vec![AREA_OFF, SIGNAL_OFF, DESC_OFF, DESC_BYTES, SIGNALS];
    crate::ensure!(got == want, op, "internal: global barrier layout of the kernels {got:?} differs from the host's {want:?} (rebuild)");
    Ok(())
}

fn write_header(op: &'static str, ctx: &Ctx, h: Header) -> Result<()> {
    let own = ctx.own_base();
    crate::ensure!(!own.is_null() && ctx.window_bytes >= CONTROL_BYTES as u64, op, "internal: no own window for the global barrier");
    // SAFETY: 8 bytes inside the control area of this rank's own live window, from a host struct
    // that lives through the synchronous copy.
    let st =
        unsafe { dek_cuda_memcpy_htod(own.cast::<u8>().add(AREA_OFF).cast(), (&h as *const Header).cast(), std::mem::size_of::<Header>()) };
    check(st, op, "writing the global barrier's header")
}

/// Sets up the global barrier of a split ctx over the LSA emulation: descriptor with every rank's
/// window base (`bases`, by world rank: the window's LSA pointers, not `ctx.peer_base`), one
/// context, the barrier's own signal table. Local, synchronous; after the window was zeroed.
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: `ctx` a live window of this rank (and
/// pointer arguments null or live and large enough until the work ran).
pub unsafe fn setup_lsa(op: &'static str, ctx: &Ctx, bases: &[*mut c_void]) -> Result<()> {
    check_layout(op)?;
    crate::kernels::transport::write_lsa_desc(op, ctx, bases, DESC_OFF, SIGNAL_OFF, 1, SIGNALS)?;
    write_header(op, ctx, Header { net_kind: NET_LSA, signal_base: 0 })
}

/// Sets up the global barrier of a split ctx over NCCL GIN: descriptor from the GIN device comms
/// and their window handles (every communicator of the buffer; a rank signals on the (communicator, context) of its
/// own rank, as the LL kernels), signal ids `signal_base..signal_base + SIGNALS` (planned above every
/// id the buffer's ops use). Local, synchronous.
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: `ctx` a live window of this rank (and
/// pointer arguments null or live and large enough until the work ran).
pub unsafe fn setup_gin(op: &'static str, ctx: &Ctx, comms: &[(&[u64], *mut c_void)], signal_base: usize) -> Result<()> {
    check_layout(op)?;
    crate::ensure!(signal_base + SIGNALS <= i32::MAX as usize, op, "internal: GIN barrier signal base {signal_base}");
    crate::kernels::transport::write_gin_desc(op, ctx, DESC_OFF, DESC_BYTES, comms)?;
    write_header(op, ctx, Header { net_kind: NET_GIN, signal_base: signal_base as i32 })
}

/// A barrier of every rank of the buffer, asynchronous on `stream` (collective; the kernel
/// records a timeout naming the rank waited for at `site` in the status block): the global
/// barrier for a ctx split over NVLink domains ([`Ctx::split`]), else the intranode flag barrier.
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: `ctx` a live window of this rank (and
/// pointer arguments null or live and large enough until the work ran).
pub unsafe fn all_ranks(op: &'static str, ctx: &Ctx, site: i32, stream: *mut c_void) -> Result<()> {
    if !ctx.split() {
        // SAFETY: launch contract: these SyncArgs carry no pointer.
        return unsafe { intranode::sync(op, ctx, &SyncArgs { site, ..Default::default() }, stream) };
    }
    // SAFETY: the ctx describes live windows (own domain) and the barrier area set up at
    // creation; the launcher validates it; asynchronous on `stream`.
    check(unsafe { dek_gb_barrier(ctx, site, stream) }, op, "global barrier kernel launch")
}

/// The first step of a collective buffer release, for every window provider: waits for the
/// device, then meets every peer at the kernel barrier (bounded by the timeout), so no peer still
/// reads or writes this rank's window: the flag barrier, or the global barrier (node phase over
/// NVLink, seam phase between rail peers) for a ctx split over NVLink domains
/// ([`all_ranks`]). A peer that never arrives is an [`Error::Timeout`]
/// naming it, and the caller must then skip its collective teardown.
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: `ctx` a live window of this rank (and
/// pointer arguments null or live and large enough until the work ran).
pub unsafe fn destroy_barrier(op: &'static str, ctx: &Ctx, status: &HostStatus, timeout_ms: u64) -> Result<()> {
    device_synchronize(op)?;
    let stream = Stream::new(op)?;
    all_ranks(op, ctx, site::DESTROY, stream.raw())?;
    stream.synchronize(op)?;
    if let Some(e) = status.error().filter(|e| e.code == err::TIMEOUT) {
        return Err(crate::error::Error::Timeout {
            op,
            rank: ctx.rank as usize,
            peers: vec![e.rank.max(0) as usize],
            timeout_ms,
            what: site::name(e.site).to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_kernels_and_fits_the_control_area() {
        check_layout("test").unwrap();
        // SAFETY: pure queries.
        let (lsa, gin) = unsafe { (dek_gb_layout(4), dek_gb_layout(5)) };
        assert!(lsa == std::mem::size_of::<crate::kernels::transport::LsaDesc>() && gin <= DESC_BYTES, "{lsa} {gin}");
        assert_eq!(gin, crate::kernels::transport::gin_net_layout().bytes);
        // Between the intranode scratch and the LL scratch (kLlCalls = CONTROL_BYTES - 1024).
        const { assert!(DESC_OFF + DESC_BYTES <= CONTROL_BYTES - 1024 && SIGNAL_OFF + 8 * SIGNALS <= DESC_OFF) };
        const { assert!(DEK_IC_RANK_TABLES_END as usize <= AREA_OFF) };
    }

    #[test]
    fn the_launcher_refuses_a_ctx_that_is_not_split() {
        let mut ctx = Ctx {
            rank: 0,
            num_ranks: 4,
            window_bytes: 1 << 20,
            host_status: 8usize as *mut _,
            timeout_ns: 1,
            num_sms: 0,
            nvl_ranks: 0,
            nvl_first: 0,
            ..Ctx::default()
        };
        ctx.peer_base[..4].fill(8usize as *mut c_void);
        let mut bad = ctx;
        bad.num_ranks = 4;
        bad.nvl_ranks = 2; // rank 0's domain is {0, 1}: ranks 2, 3 must be NULL
        for c in [ctx, bad] {
            // SAFETY: the launcher rejects these before touching anything.
            assert_ne!(unsafe { dek_gb_barrier(&c, 8, std::ptr::null_mut()) }, 0);
        }
    }

    #[test]
    fn launchers_accept_a_split_ctx_exactly_with_null_outside_the_domain() {
        // Rank 3 of 2 x 2: windows of ranks 2, 3 only, at slots 2, 3 (rank % 8; nvl_first 2).
        let mut c = Ctx {
            rank: 3,
            num_ranks: 4,
            window_bytes: 1 << 20,
            host_status: 8usize as *mut _,
            timeout_ns: 1,
            nvl_ranks: 2,
            nvl_first: 2,
            ..Ctx::default()
        };
        c.peer_base[2] = 0x10000usize as *mut c_void;
        c.peer_base[3] = 0x20000usize as *mut c_void;
        assert_eq!((c.own_base() as usize, c.base_of(2) as usize, c.addressed_ranks()), (0x20000, 0x10000, vec![2, 3]));
        assert!(c.base_of(0).is_null() && c.base_of(1).is_null());
        // The rendezvous word is pure address arithmetic behind the launchers' ctx check.
        assert_eq!(intranode::rendezvous_word(&c) as usize, 0x20000 + 4096 + 12);
        let mut other = c;
        other.peer_base[0] = 0x30000usize as *mut c_void; // an entry outside the domain: refused
        assert!(intranode::rendezvous_word(&other).is_null());
        let mut missing = c;
        missing.peer_base[2] = std::ptr::null_mut(); // a rank of the own domain without a window
        assert!(intranode::rendezvous_word(&missing).is_null());
        let mut first = c;
        first.nvl_first = 0; // not rank / D * D
        assert!(intranode::rendezvous_word(&first).is_null());
        let mut odd = c;
        odd.nvl_ranks = 3; // does not divide the ranks
        assert!(intranode::rendezvous_word(&odd).is_null());
        // Intranode launchers still want every window.
        let args = SyncArgs::default();
        // SAFETY: the launcher refuses this ctx before any device work (what the test checks).
        assert!(unsafe { intranode::sync("test", &c, &args, std::ptr::null_mut()) }.is_err());
    }

    #[test]
    fn split_means_some_rank_has_no_window_pointer() {
        let mut c = Ctx { rank: 1, num_ranks: 4, ..Ctx::default() };
        assert!(!c.split());
        c.nvl_ranks = 2;
        assert!(c.split());
        c.nvl_ranks = 4;
        assert!(!c.split());
    }
}
