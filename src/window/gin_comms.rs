//! The extra NCCL communicators of an internode buffer over GIN (`DEEP_EP_GIN_COMMS` = N > 1, for
//! more QPs per peer: each communicator brings its own GIN contexts). The buffer's own communicator
//! (`nccl_window::Window`) is the first; this module owns the other N - 1.
//!
//! Each extra communicator is split from the buffer's (`ncclCommSplit`, one color, key = rank: the
//! same ranks in the same order; `splitShare` = 0 so it gets its own network resources), gets a GIN
//! device comm before any memory is registered on it (as the first one), then registers the same
//! `ncclMemAlloc` memory as a symmetric window. Every step is collective over the buffer's ranks
//! and runs in the same order on every rank (communicator 1, 2, ...).
//!
//! Teardown ([`Step`], driven by `nccl_window::teardown_steps`): every GIN device comm (extras
//! first, newest first) before any window deregistration, the memory after every deregistration,
//! the extra communicators (newest first) before the buffer's own. The local path
//! ([`GinComms::abort`]) aborts the extra communicators before the buffer's own.

use crate::error::{Error, Result};
use crate::kernels::transport::{gin_devcomm_create, GinGrant, GinReqs};
use crate::sys::kernels::*;
use crate::sys::nccl::{self, ncclComm_t, ncclConfig_t, ncclWindow_t, nccl_fn, DeviceApi, NcclLib};
use std::ffi::{c_int, c_void};

/// What a window asks `ncclDevCommCreate` for GIN, and who judges the answer.
pub struct GinSetup<'a> {
    /// Requirements of every communicator (`backend::peer::gin::GinPlan::requirements`).
    pub reqs: GinReqs,
    /// GIN communicators (`DEEP_EP_GIN_COMMS`, >= 1): the window's own and `comms - 1` split from
    /// it (`window::gin_comms`).
    pub comms: usize,
    /// Turns NCCL's answer on communicator `i` (the device comm and what it granted, or the NCCL
    /// result code) into `Ok` or the error that explains it (`backend::peer::gin::granted_on`).
    pub judge: &'a dyn Fn(usize, GinGrant) -> Result<()>,
}

/// Creates the GIN device comm of `g` on `comm` (communicator `index` of the buffer) through
/// `create_fn` and has `g.judge` accept it. A device comm the judge refuses is left to the
/// communicator's teardown (abort frees it).
///
/// # Safety
/// `create_fn` must have the prototype of `ncclDevCommCreate` (the loaded NCCL's, or a stand-in in
/// tests) and `comm` be a communicator it accepts.
pub unsafe fn gin_setup(create_fn: *mut c_void, comm: *mut c_void, index: usize, g: &GinSetup) -> Result<Vec<u64>> {
    let r = gin_devcomm_create(create_fn, comm, &g.reqs);
    let devcomm = r.as_ref().ok().map(|(d, _)| d.clone());
    (g.judge)(index, r)?;
    devcomm.ok_or_else(|| Error::invalid(crate::op_names::CREATE_BUFFER, "internal: a failed GIN device comm creation was accepted"))
}

/// `NCCL_CONFIG_UNDEF_INT` (INT_MIN): "not set, use the parent's or NCCL's default".
const UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_CONFIG_INITIALIZER`'s magic.
const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// The `ncclConfig_t` of a split: `NCCL_CONFIG_INITIALIZER` (the headers' version, every attribute
/// unset, so inherited from the parent) with `splitShare` = 0: the child must not share the
/// parent's network resources, or it would add no QPs.
pub fn split_config() -> ncclConfig_t {
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: nccl::NCCL_VERSION_CODE,
        blocking: UNDEF_INT,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: 0,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
    }
}

/// One step of the teardown of extra communicator `i` (0-based among the extras, i.e. the
/// buffer's communicator `i + 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `ncclDevCommDestroy` of its GIN device comm.
    GinDevComm(usize),
    /// `ncclCommWindowDeregister` of its registration of the buffer's memory.
    Deregister(usize),
    /// `ncclCommFinalize` then `ncclCommDestroy`.
    Comm(usize),
}

/// One extra communicator and what it holds.
struct Extra {
    comm: ncclComm_t,
    gin_devcomm: Option<Vec<u64>>,
    win: ncclWindow_t,
}

/// The extra GIN communicators of one buffer (none for `DEEP_EP_GIN_COMMS` = 1).
#[derive(Default)]
pub struct GinComms {
    extra: Vec<Extra>,
}

// SAFETY: plain NCCL handles, usable from any thread; used under the buffer's mutex.
unsafe impl Send for GinComms {}

impl GinComms {
    /// Collective over the ranks of `parent`: splits `count` communicators from it and creates the
    /// GIN device comm of each (`g`, judged as communicator 1, 2, ...), before any memory is
    /// registered on them. What was created stays held on failure, for the owner's teardown.
    ///
    /// # Safety
    /// `parent` must be a live communicator of `lib` on which this rank is `rank`.
    pub unsafe fn open(
        &mut self,
        lib: &NcclLib,
        api: &DeviceApi,
        parent: ncclComm_t,
        rank: usize,
        count: usize,
        g: &GinSetup,
    ) -> Result<()> {
        let split = nccl_fn!(lib, ncclCommSplit);
        let user_rank = nccl_fn!(lib, ncclCommUserRank);
        for i in 0..count {
            let mut comm: ncclComm_t = std::ptr::null_mut();
            let mut config = split_config();
            // SAFETY: live parent; writes one communicator handle; the config lives through the call.
            let res = unsafe { split(parent, 0, rank as c_int, &mut comm, &mut config) };
            nccl::check(lib, res, "ncclCommSplit (GIN communicator)")?;
            crate::ensure!(
                !comm.is_null(),
                crate::op_names::CREATE_BUFFER,
                "internal: ncclCommSplit returned no communicator on rank {rank}"
            );
            self.extra.push(Extra { comm, gin_devcomm: None, win: std::ptr::null_mut() });
            let mut r: c_int = -1;
            // SAFETY: live communicator; writes one int.
            nccl::check(lib, unsafe { user_rank(comm, &mut r) }, "ncclCommUserRank")?;
            crate::ensure!(
                r as usize == rank,
                crate::op_names::CREATE_BUFFER,
                "internal: rank {rank} is rank {r} of its split GIN communicator"
            );
            // SAFETY: ncclDevCommCreate of the loaded NCCL on the live communicator.
            let dc = gin_setup(api.dev_comm_create, comm.cast(), i + 1, g)?;
            self.extra.last_mut().expect("pushed above").gin_devcomm = Some(dc);
        }
        Ok(())
    }

    /// Collective: registers `bytes` of `mem` (from `ncclMemAlloc`, already registered on the
    /// buffer's communicator) as a symmetric window on every extra communicator.
    ///
    /// # Safety
    /// `mem` must be a live `ncclMemAlloc` allocation of at least `bytes` bytes that outlives the
    /// registrations (freed only after [`Step::Deregister`] or [`GinComms::abort`]).
    pub unsafe fn register(&mut self, lib: &NcclLib, mem: *mut c_void, bytes: usize) -> Result<()> {
        let register = nccl_fn!(lib, ncclCommWindowRegister);
        for e in &mut self.extra {
            // SAFETY: `mem` holds `bytes` bytes from ncclMemAlloc; writes one window handle.
            let res = unsafe { register(e.comm, mem, bytes, &mut e.win, nccl::NCCL_WIN_COLL_SYMMETRIC as c_int) };
            nccl::check(lib, res, "ncclCommWindowRegister (GIN communicator)")?;
        }
        Ok(())
    }

    /// Extra communicators held.
    pub fn len(&self) -> usize {
        self.extra.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.extra.is_empty()
    }

    /// The GIN device comm and window handle of every extra communicator, in order (for the
    /// device descriptor); None until [`GinComms::register`] completed.
    pub fn pairs(&self) -> Option<Vec<(&[u64], *mut c_void)>> {
        self.extra.iter().map(|e| Some((e.gin_devcomm.as_deref()?, (!e.win.is_null()).then_some(e.win.cast())?))).collect()
    }

    /// One step of the collective teardown; a step whose resource is gone is a no-op.
    pub fn teardown(&mut self, lib: &NcclLib, api: &DeviceApi, step: Step) -> Result<()> {
        let i = match step {
            Step::GinDevComm(i) | Step::Deregister(i) | Step::Comm(i) => i,
        };
        let Some(e) = self.extra.get_mut(i) else { return Ok(()) };
        if e.comm.is_null() {
            return Ok(());
        }
        match step {
            Step::GinDevComm(_) => {
                let Some(dc) = e.gin_devcomm.take() else { return Ok(()) };
                // SAFETY: the devcomm was created on this communicator and is destroyed once.
                let res = unsafe { dek_nccl_devcomm_destroy(api.dev_comm_destroy, e.comm.cast(), dc.as_ptr().cast()) };
                nccl::check(lib, nccl::ncclResult_t(res as _), "ncclDevCommDestroy (GIN communicator)")
            }
            Step::Deregister(_) => {
                if e.win.is_null() {
                    return Ok(());
                }
                let win = std::mem::replace(&mut e.win, std::ptr::null_mut());
                let f = nccl_fn!(lib, ncclCommWindowDeregister);
                // SAFETY: registered on this communicator; deregistered once.
                nccl::check(lib, unsafe { f(e.comm, win) }, "ncclCommWindowDeregister (GIN communicator)")
            }
            Step::Comm(_) => {
                let comm = std::mem::replace(&mut e.comm, std::ptr::null_mut());
                let fin = nccl_fn!(lib, ncclCommFinalize);
                // SAFETY: live communicator.
                let r = nccl::check(lib, unsafe { fin(comm) }, "ncclCommFinalize (GIN communicator)");
                let destroy = nccl_fn!(lib, ncclCommDestroy);
                // SAFETY: live communicator, destroyed once.
                let d = nccl::check(lib, unsafe { destroy(comm) }, "ncclCommDestroy (GIN communicator)");
                r.and(d)
            }
        }
    }

    /// Local release (no peer involved), newest first: aborts every extra communicator still
    /// held (which releases its device comm and window). Errors are logged, never raised. Call
    /// before aborting the buffer's own communicator and freeing the memory.
    pub fn abort(&mut self, lib: &NcclLib) {
        for e in self.extra.iter_mut().rev() {
            let comm = std::mem::replace(&mut e.comm, std::ptr::null_mut());
            (e.gin_devcomm, e.win) = (None, std::ptr::null_mut());
            if comm.is_null() {
                continue;
            }
            match lib.ncclCommAbort.as_ref() {
                // SAFETY: live communicator, aborted once.
                Ok(f) => {
                    if let Err(err) = nccl::check(lib, unsafe { f(comm) }, "ncclCommAbort (GIN communicator)") {
                        eprintln!("deep_ep: releasing an NCCL buffer: {err}");
                    }
                }
                Err(err) => eprintln!("deep_ep: releasing an NCCL buffer: ncclCommAbort missing: {err}"),
            }
        }
        self.extra.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_config_is_the_initializer_with_split_share_off() {
        let c = split_config();
        assert_eq!((c.size, c.magic, c.version as i64), (std::mem::size_of::<ncclConfig_t>(), 0xcafe_beef, nccl::NCCL_VERSION_CODE as i64));
        assert!(c.version >= 22800);
        assert_eq!(c.splitShare, 0);
        assert_eq!((c.blocking, c.shrinkShare, c.nvlinkCentricSched), (c_int::MIN, c_int::MIN, c_int::MIN));
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn an_empty_set_has_nothing_to_tear_down() {
        let mut g = GinComms::default();
        assert!(g.is_empty() && g.pairs() == Some(vec![]));
        // Steps of communicators that were never created are no-ops (no NCCL call).
        let lib = nccl::library();
        if let (Ok(lib), Ok(api)) = (lib, nccl::device_api()) {
            for s in [Step::GinDevComm(0), Step::Deregister(1), Step::Comm(2)] {
                g.teardown(lib, api, s).unwrap();
            }
            g.abort(lib);
        }
    }
}
