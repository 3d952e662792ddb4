//! One NCCL communicator with one symmetric window: what a buffer of the `nccl` backend owns
//! (intranode, or internode with the kernels' peer pointers limited to the own NVLink domain). Creation and [`Window::close`] are collective; dropping a window that was not
//! closed releases it locally (communicator aborted), which is the path for buffers whose ranks
//! fell out of step.
//!
//! Creation (the order verified on the GPU machine, docs/DEVICE.md): `ncclCommInitRank` →
//! (internode buffers over NCCL GIN only: `ncclDevCommCreate` with GIN requirements, before any
//! memory is registered, since NCCL registers memory with its GIN transport when the memory is
//! registered and GIN is already enabled on the communicator) → `ncclMemAlloc` + `ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)` → `ncclDevCommCreate`
//! (zeroed requirements, one LSA barrier, no multimem; it proves the device-comm path and tells
//! the LSA team, checked against the buffer's NVLink domains by [`PeerMap`]) → the LSA team's
//! window pointers (a kernel calls `ncclGetLsaPointer`), of which `Ctx::peer_base` keeps the
//! own NVLink domain only for an internode buffer → host-mapped status block → control area
//! zeroed → an all-reduce of one int as the host rendezvous, so no peer signals into a control
//! area that is not zeroed yet.

use crate::error::{Error, Result};
use crate::kernels::intranode::{self, Ctx, DeviceGuard, HostStatus, Stream};
use crate::kernels::layout::check as cuda_check;

use super::peer_window::{PeerWindow, WindowArgs};
use crate::sys::kernels::*;
use crate::sys::nccl::{self, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId, ncclWindow_t, nccl_fn, DeviceApi, NcclLib};
#[cfg(test)]
use crate::window::gin_comms::GinSetup;
use crate::window::gin_comms::{self, gin_setup, GinComms};
use crate::window::lsa_team::PeerMap;
use std::ffi::{c_int, c_void};

const OP: &str = crate::op_names::CREATE_BUFFER;
const DESTROY: &str = crate::op_names::DESTROY_BUFFER;

/// One step of [`Window::close`]'s teardown, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Teardown {
    /// `ncclDevCommDestroy` of the GIN device comm.
    GinDevComm,
    /// `ncclDevCommDestroy` of the window's own device comm.
    DevComm,
    /// `ncclCommWindowDeregister`.
    Deregister,
    /// `ncclMemFree`.
    MemFree,
    /// `ncclCommFinalize` then `ncclCommDestroy`.
    Comm,
    /// A step of an extra GIN communicator (`window::gin_comms`; a no-op for what it does not hold).
    Extra(gin_comms::Step),
}

/// The teardown of a window holding what the flags say, with `extra` GIN communicators split from
/// its own: device comms first (they reference the communicators' GIN and LSA resources; the extra
/// ones newest first), then the window registrations (the extra ones first), the memory once no
/// communicator has it registered, the extra communicators (newest first), the window's own last.
pub fn teardown_steps(extra: usize, gin: bool, devcomm: bool, win: bool, mem: bool) -> Vec<Teardown> {
    use gin_comms::Step;
    let each = |f: fn(usize) -> Step| (0..extra).rev().map(move |i| Teardown::Extra(f(i)));
    let mut steps: Vec<Teardown> = each(Step::GinDevComm).collect();
    let have = [(gin, Teardown::GinDevComm), (devcomm, Teardown::DevComm)];
    steps.extend(have.iter().filter(|(h, _)| *h).map(|(_, s)| *s));
    steps.extend(each(Step::Deregister));
    let have = [(win, Teardown::Deregister), (mem, Teardown::MemFree)];
    steps.extend(have.iter().filter(|(h, _)| *h).map(|(_, s)| *s));
    steps.extend(each(Step::Comm));
    steps.push(Teardown::Comm);
    steps
}

/// A communicator, its device comm and one symmetric window with its control area.
pub struct Window {
    lib: &'static NcclLib,
    api: &'static DeviceApi,
    device: i32,
    comm: ncclComm_t,
    /// The GIN device comm (internode buffers over GIN), created before the window registration.
    gin_devcomm: Option<Vec<u64>>,
    /// The GIN communicators split from `comm` (`DEEP_EP_GIN_COMMS` > 1), each with its GIN device
    /// comm (created right after `gin_devcomm`, before any memory is registered) and a registration
    /// of `mem` (right after `win`); torn down around the window's own steps (`teardown_steps`).
    gin_comms: GinComms,
    devcomm: Option<Vec<u64>>,
    mem: *mut c_void,
    win: ncclWindow_t,
    pub(super) bytes: usize,
    pub(super) ctx: Ctx,
    /// Window base of every rank in NCCL's LSA team, by world rank (NULL outside it): more than
    /// `ctx.peer_base` for an internode buffer on one NVLink machine (the LSA emulation's reach).
    pub(super) lsa_base: Vec<*mut c_void>,
    pub(super) status: Option<HostStatus>,
    /// Never free `mem` (a zero-copy view of it was handed out): deregistered, kept mapped.
    keep_mem: bool,
}

// SAFETY: the handles are plain NCCL/CUDA handles, usable from any thread; a window is only used
// under its buffer's mutex.
unsafe impl Send for Window {}

fn nccl_check(lib: &NcclLib, res: nccl::ncclResult_t, what: &str) -> Result<()> {
    nccl::check(lib, res, what)
}

impl Window {
    /// Collective over `num_ranks` processes (one per GPU): one NVLink domain, or several of
    /// `a.nvl_domain` ranks (NCCL's LSA team the whole buffer on one machine, or exactly the own
    /// domain over GIN).
    pub fn create(a: &WindowArgs) -> Result<Window> {
        intranode::check_struct_sizes(OP)?;
        let lib = nccl::library()?;
        let api = nccl::device_api()?;
        crate::ensure!(a.num_ranks >= 1 && a.num_ranks <= crate::kernels::internode::MAX_RANKS, OP, "internal: {} ranks", a.num_ranks);
        let _guard = DeviceGuard::new(OP, a.device)?;
        let bytes = super::peer_window::window_bytes(a.data_bytes);
        let mut w = Window {
            lib,
            api,
            device: a.device,
            comm: std::ptr::null_mut(),
            gin_devcomm: None,
            gin_comms: GinComms::default(),
            devcomm: None,
            mem: std::ptr::null_mut(),
            win: std::ptr::null_mut(),
            bytes,
            ctx: super::peer_window::new_ctx(a.rank, a.num_ranks, bytes, a.timeout_ns, intranode::sm_count(OP, a.device)?),
            lsa_base: Vec::new(),
            status: None,
            keep_mem: false,
        };
        // From here on a failure returns early and Drop releases what exists.
        let mut id = ncclUniqueId::default();
        for (d, s) in id.internal.iter_mut().zip(a.unique_id.iter()) {
            *d = *s as _;
        }
        let init = nccl_fn!(lib, ncclCommInitRank);
        // SAFETY: writes one communicator handle; the id is 128 bytes by value.
        nccl_check(lib, unsafe { init(&mut w.comm, a.num_ranks as c_int, id, a.rank as c_int) }, "ncclCommInitRank")?;
        if let Some(g) = &a.gin {
            // SAFETY: ncclDevCommCreate of the loaded NCCL on the live communicator.
            w.gin_devcomm = Some(unsafe { gin_setup(api.dev_comm_create, w.comm.cast(), 0, g) }?);
            // SAFETY: the live communicator of this rank.
            unsafe { w.gin_comms.open(lib, api, w.comm, a.rank, g.comms.saturating_sub(1), g) }?;
        }

        let mem_alloc = nccl_fn!(lib, ncclMemAlloc);
        // SAFETY: writes one device pointer; the size is a multiple of 2 MiB.
        nccl_check(lib, unsafe { mem_alloc(&mut w.mem, bytes) }, "ncclMemAlloc").map_err(|e| {
            Error::invalid(
                OP,
                format!(
                    "cannot allocate {bytes} bytes ({:.2} GiB) of GPU memory for the buffer's window on cuda:{} ({e}); \
                     ask for fewer num_nvl_bytes / num_rdma_bytes or free GPU memory",
                    bytes as f64 / (1u64 << 30) as f64,
                    a.device
                ),
            )
        })?;
        let register = nccl_fn!(lib, ncclCommWindowRegister);
        // SAFETY: `mem` holds `bytes` bytes from ncclMemAlloc; writes one window handle.
        let res = unsafe { register(w.comm, w.mem, bytes, &mut w.win, nccl::NCCL_WIN_COLL_SYMMETRIC as c_int) };
        nccl_check(lib, res, "ncclCommWindowRegister")?;
        // SAFETY: the same allocation; freed only after every registration (teardown_steps, Drop).
        unsafe { w.gin_comms.register(lib, w.mem, bytes) }?;
        // SAFETY: pure query of the glue's struct size.
        let dc_bytes = unsafe { dek_nccl_devcomm_bytes() };
        let mut devcomm = vec![0u64; dc_bytes.div_ceil(8)];
        let (mut lsa_size, mut lsa_rank): (c_int, c_int) = (0, 0);
        // SAFETY: the glue calls ncclDevCommCreate (address resolved from the loaded NCCL) with a
        // live communicator and writes a devcomm of `dc_bytes` into our 8-aligned buffer.
        let res = unsafe {
            dek_nccl_devcomm_create(
                api.dev_comm_create,
                w.comm.cast(),
                1,
                devcomm.as_mut_ptr().cast(),
                dc_bytes,
                &mut lsa_size,
                &mut lsa_rank,
            )
        };
        nccl_check(lib, nccl::ncclResult_t(res as _), "ncclDevCommCreate")?;
        w.devcomm = Some(devcomm);
        crate::ensure!(lsa_size >= 1 && lsa_rank >= 0, OP, "NCCL reported LSA rank {lsa_rank} of {lsa_size}");
        let map = PeerMap::new(OP, a.rank, a.num_ranks, a.nvl_domain, lsa_size as usize, lsa_rank as usize, a.gin.is_some())?;
        let mut lsa = vec![std::ptr::null_mut(); map.lsa_size];
        // SAFETY: the window is live; writes lsa_size pointers into `lsa`, which holds as many.
        let st = unsafe { dek_nccl_window_lsa_bases(w.win.cast(), map.lsa_size as c_int, lsa.as_mut_ptr()) };
        cuda_check(st, OP, "reading the window's peer pointers")?;
        (w.ctx.peer_base, w.lsa_base) = map.spread(&lsa);
        w.ctx.nvl_ranks = map.ctx_nvl_ranks as i32;
        w.ctx.nvl_first = map.ctx_first() as i32;
        crate::ensure!(
            (0..a.num_ranks).all(|p| w.ctx.base_of(p).is_null() != map.in_ctx(p)),
            OP,
            "NCCL gave no window pointer for a rank of this NVLink domain"
        );

        let stream = Stream::new(OP)?;
        // SAFETY: `peer_base[rank]` is the window just registered, of `window_bytes`.
        w.status = Some(unsafe { super::peer_window::attach_status_and_zero(OP, &mut w.ctx, &stream) }?);
        let all_reduce = nccl_fn!(lib, ncclAllReduce);
        let word = intranode::rendezvous_word(&w.ctx);
        // SAFETY: one int of this rank's window, on our private stream.
        let res = unsafe { all_reduce(word, word, 1, ncclDataType_t::ncclInt32, ncclRedOp_t::ncclSum, w.comm, stream.raw()) };
        nccl_check(lib, res, "ncclAllReduce (create rendezvous)")?;
        stream.synchronize(OP)?;
        if let Some(stride) = a.transport_self_test {
            // After the rendezvous: every rank's signals are zero. The self-test runs over the
            // LSA emulation, on every rank's window (not only the kernels' own domain).
            crate::ensure!(map.whole_buffer(), OP, "DEEP_EP_TRANSPORT_SELFTEST runs over the LSA emulation and needs every rank in NCCL's LSA team ({} of {} here): unset it across machines", map.lsa_size, a.num_ranks);
            let full = Ctx { peer_base: super::lsa_team::whole_buffer_ctx_bases(OP, &w.lsa_base)?, nvl_ranks: 0, nvl_first: 0, ..w.ctx };
            // SAFETY: launch contract: the ctx of this live window, zeroed and past the host rendezvous.
            unsafe { crate::kernels::transport::lsa_self_test_run(OP, &full, stride, a.timeout_ns, stream.raw()) }?;
        }
        Ok(w)
    }

    /// See `PeerWindow::keep_memory`: the release deregisters the window but never frees it.
    pub fn keep_memory(&mut self) {
        self.keep_mem = true;
    }

    /// See `PeerWindow::own_memory`: the `ncclMemAlloc` allocation, which `keep_memory` keeps
    /// mapped (the LSA pointer in `ctx` is unmapped by the release).
    pub fn own_memory(&self) -> *mut c_void {
        self.mem
    }

    /// The GIN device comm (byte copy of `ncclDevComm`) and the `ncclWindow_t` it reaches the
    /// window through, when the window was created with [`WindowArgs::gin`].
    pub fn gin(&self) -> Option<(&[u64], *mut c_void)> {
        self.gin_devcomm.as_deref().map(|d| (d, self.win.cast()))
    }

    /// [`Window::gin`] of every GIN communicator, the window's own first, then those split from it
    /// (`DEEP_EP_GIN_COMMS`); empty without GIN.
    pub fn gin_all(&self) -> Vec<(&[u64], *mut c_void)> {
        match (self.gin(), self.gin_comms.pairs()) {
            (Some(own), Some(extra)) => std::iter::once(own).chain(extra).collect(),
            _ => Vec::new(),
        }
    }

    /// Collective release: waits for the device, meets every peer at a barrier (so none still
    /// reads this window; the global barrier for an internode buffer, which the backend set up at
    /// creation), then tears NCCL down in order. On a barrier timeout the window is
    /// released locally instead (communicator aborted) and the timeout is returned.
    pub fn close(&mut self, timeout_ms: u64) -> Result<()> {
        if self.comm.is_null() {
            return Ok(());
        }
        let _guard = DeviceGuard::new(DESTROY, self.device)?;
        // SAFETY: launch contract: the ctx of this live window; the barrier passes no other pointer.
        unsafe { crate::kernels::global_barrier::destroy_barrier(DESTROY, &self.ctx, self.status(), timeout_ms) }?;
        let mut first: Result<()> = Ok(());
        let mut note = |r: Result<()>| {
            if first.is_ok() {
                first = r;
            }
        };
        for step in teardown_steps(
            self.gin_comms.len(),
            self.gin_devcomm.is_some(),
            self.devcomm.is_some(),
            !self.win.is_null(),
            !self.mem.is_null(),
        ) {
            note(self.teardown(step));
        }
        self.comm = std::ptr::null_mut();
        first
    }
}

impl Window {
    /// One step of the collective teardown ([`teardown_steps`]).
    fn teardown(&mut self, step: Teardown) -> Result<()> {
        match step {
            Teardown::Extra(s) => self.gin_comms.teardown(self.lib, self.api, s),
            Teardown::GinDevComm | Teardown::DevComm => {
                let dc = if step == Teardown::GinDevComm { self.gin_devcomm.take() } else { self.devcomm.take() };
                let Some(dc) = dc else { return Ok(()) };
                // SAFETY: the devcomm was created on this communicator and is destroyed once.
                let res = unsafe { dek_nccl_devcomm_destroy(self.api.dev_comm_destroy, self.comm.cast(), dc.as_ptr().cast()) };
                nccl_check(self.lib, nccl::ncclResult_t(res as _), "ncclDevCommDestroy")
            }
            Teardown::Deregister => {
                let win = std::mem::replace(&mut self.win, std::ptr::null_mut());
                let f = nccl_fn!(self.lib, ncclCommWindowDeregister);
                // SAFETY: the window was registered on this communicator; deregistered once.
                nccl_check(self.lib, unsafe { f(self.comm, win) }, "ncclCommWindowDeregister")
            }
            Teardown::MemFree => {
                let mem = std::mem::replace(&mut self.mem, std::ptr::null_mut());
                if self.keep_mem {
                    return Ok(());
                }
                let f = nccl_fn!(self.lib, ncclMemFree);
                // SAFETY: allocated by ncclMemAlloc, no longer registered; freed once.
                nccl_check(self.lib, unsafe { f(mem) }, "ncclMemFree")
            }
            Teardown::Comm => {
                let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
                let fin = nccl_fn!(self.lib, ncclCommFinalize);
                // SAFETY: live communicator.
                let r = nccl_check(self.lib, unsafe { fin(comm) }, "ncclCommFinalize");
                let destroy = nccl_fn!(self.lib, ncclCommDestroy);
                // SAFETY: live communicator, destroyed once.
                let d = nccl_check(self.lib, unsafe { destroy(comm) }, "ncclCommDestroy");
                r.and(d)
            }
        }
    }
}

impl Drop for Window {
    /// Local release (no peer involved): abort the communicator, free the memory. Errors are
    /// logged, never raised.
    fn drop(&mut self) {
        let _guard = DeviceGuard::new(DESTROY, self.device).ok();
        if !self.comm.is_null() {
            // Let queued kernels that read or write the window finish first (they are bounded
            // by the barrier timeout).
            if let Err(e) = intranode::device_synchronize(DESTROY) {
                eprintln!("deep_ep: releasing an NCCL buffer: {e}");
            }
            self.gin_comms.abort(self.lib);
            match self.lib.ncclCommAbort.as_ref() {
                // SAFETY: live communicator, aborted once.
                Ok(f) => {
                    if let Err(e) = nccl_check(self.lib, unsafe { f(self.comm) }, "ncclCommAbort") {
                        eprintln!("deep_ep: releasing an NCCL buffer: {e}");
                    }
                }
                Err(e) => eprintln!("deep_ep: releasing an NCCL buffer: ncclCommAbort missing: {e}"),
            }
            self.comm = std::ptr::null_mut();
        }
        if !self.mem.is_null() && !self.keep_mem {
            if let Ok(f) = self.lib.ncclMemFree.as_ref() {
                // SAFETY: allocated by ncclMemAlloc; its communicator is gone; freed once.
                if let Err(e) = nccl_check(self.lib, unsafe { f(self.mem) }, "ncclMemFree") {
                    eprintln!("deep_ep: releasing an NCCL buffer: {e}");
                }
            }
            self.mem = std::ptr::null_mut();
        }
    }
}

super::peer_window::forward_peer_window!(
    Window,
    keep_memory() -> (),
    own_memory() -> *mut std::ffi::c_void,
    lsa_bases() -> Vec<*mut std::ffi::c_void>,
    gin() -> Option<(&[u64], *mut std::ffi::c_void)>,
    gin_all() -> Vec<(&[u64], *mut std::ffi::c_void)>
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::peer::gin::{buffer_plan, granted_on, route, GinKnobs, MAX_GIN_COMMS};
    use crate::backend::peer::ll_seam::DESC_BYTES;
    use crate::kernels::transport::GinInfo;
    use crate::kernels::transport::{build_gin_net, devcomm_bytes, devcomm_fill, device_gin_route, gin_net_layout, MAX_GIN_CONTEXTS};

    // Stand-ins for ncclDevCommCreate (the glue zeroes the device comm before calling them).
    fn grant(out: *mut c_void, contexts: i32) -> c_int {
        let info = GinInfo {
            rank: 1,
            num_ranks: 4,
            lsa_rank: 1,
            lsa_size: 4,
            gin_context_count: contexts,
            gin_type: 3,
            gin_signal_count: (crate::backend::peer::signals::LL_SIGNALS
                + crate::kernels::internode::SEAM_SIGNALS
                + crate::backend::peer::signals::BARRIER_SIGNALS) as i32,
            gin_counter_count: 0,
        };
        // SAFETY: the glue hands a zeroed ncclDevComm of devcomm_bytes().
        unsafe { devcomm_fill(out, &info) }
    }
    extern "C" fn fake_grant(_comm: *mut c_void, _reqs: *const u8, out: *mut c_void) -> c_int {
        grant(out, 2)
    }
    extern "C" fn fake_grant4(_comm: *mut c_void, _reqs: *const u8, out: *mut c_void) -> c_int {
        grant(out, 4)
    }
    /// What NCCL does without a GPUDirect-RDMA NIC when GIN is not forced: a device comm with no
    /// GIN context.
    extern "C" fn fake_no_gin(_comm: *mut c_void, _reqs: *const u8, _out: *mut c_void) -> c_int {
        0
    }
    /// ... and when it is forced (`ginForceEnable`): an error (ncclSystemError).
    extern "C" fn fake_fail(_comm: *mut c_void, _reqs: *const u8, _out: *mut c_void) -> c_int {
        2
    }

    type Create = extern "C" fn(*mut c_void, *const u8, *mut c_void) -> c_int;

    /// The GIN step of an LL buffer's creation on rank 1 of 2 x 2 for communicator `index` of
    /// `comms` (`DEEP_EP_GIN_COMMS`), as `PeerBackend::create` wires it.
    fn setup(create: Create, comms: usize, index: usize) -> Result<Vec<u64>> {
        let n = comms.to_string();
        let k = GinKnobs::parse(|v| match v {
            "DEEP_EP_RDMA_TRANSPORT" => Some("gin".to_string()),
            "DEEP_EP_GIN_COMMS" => Some(n.clone()),
            _ => None,
        })
        .unwrap();
        let p = buffer_plan(&k, 4, 2, true).unwrap().expect("a GIN plan");
        assert_eq!(p.num_comms, comms);
        let judge = |i, r| granted_on(&p, &k, 1, i, r, |c| format!("(text of {c})")).map(|_| ());
        // SAFETY: the stand-ins have the prototype of ncclDevCommCreate and ignore the communicator.
        unsafe { gin_setup(create as *mut c_void, 8 as *mut c_void, index, &GinSetup { reqs: p.requirements(), comms, judge: &judge }) }
    }

    #[test]
    fn gin_setup_keeps_a_granted_device_comm_and_explains_a_refusal() {
        let dc = setup(fake_grant, 1, 0).unwrap();
        assert!(dc.len() * 8 >= devcomm_bytes());
        let e = setup(fake_no_gin, 1, 0).unwrap_err().to_string();
        assert!(e.starts_with("deep_ep::create_buffer: GIN setup on rank 1 failed: NCCL GPU-initiated networking is unavailable: ncclDevCommCreate granted 0 GIN contexts (4 asked)"), "{e}");
        assert!(e.contains("GPUDirect-RDMA capable NIC") && e.contains("set DEEP_EP_RDMA_TRANSPORT=lsa"), "{e}");
        let e = setup(fake_fail, 1, 0).unwrap_err().to_string();
        assert!(e.contains("GIN setup on rank 1 failed: NCCL GPU-initiated networking is unavailable: ncclDevCommCreate failed: ncclResult_t 2 (text of 2)"), "{e}");
        // Several communicators: each grant is judged on its own, and the error names the rank
        // and the communicator.
        assert!(setup(fake_grant, 3, 2).is_ok());
        let e = setup(fake_fail, 3, 0).unwrap_err().to_string();
        assert!(e.starts_with("deep_ep::create_buffer: GIN setup on rank 1 (communicator 0 of 3) failed: NCCL GPU-initiated networking is unavailable: ncclDevCommCreate failed"), "{e}");
        assert!(e.contains("12 QPs per peer (3 communicator(s) x 4 contexts)"), "{e}");
        let e = setup(fake_no_gin, 2, 1).unwrap_err().to_string();
        assert!(e.contains("GIN setup on rank 1 (communicator 1 of 2) failed: NCCL GPU-initiated networking is unavailable: ncclDevCommCreate granted 0 GIN contexts"), "{e}");
    }

    fn bytes_of(w: &[u64]) -> Vec<u8> {
        w.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    fn i32_at(b: &[u8], off: usize) -> i32 {
        i32::from_ne_bytes(b[off..off + 4].try_into().unwrap())
    }

    #[test]
    fn gin_descriptor_holds_every_communicator_and_the_fewest_granted_contexts() {
        let l = gin_net_layout();
        let n = devcomm_bytes();
        assert_eq!(l.capacity, MAX_GIN_COMMS);
        assert!(l.bytes <= DESC_BYTES && l.align <= 8 && l.win_off >= n && l.win_off + 8 <= l.stride, "{l:?}");
        assert!(l.comms_off >= l.stride * l.capacity && l.contexts_off >= l.comms_off + 4 && l.contexts_off + 4 <= l.bytes, "{l:?}");
        let wins: Vec<*mut c_void> = (0..MAX_GIN_COMMS).map(|i| (0xdead_0000usize + 0x100 * (i + 1)) as *mut c_void).collect();
        // One communicator granted 2 contexts; then 3 (4, 2, 4 granted: 2 used); then all 8.
        for (creates, fewest) in [
            (vec![fake_grant as Create], 2),
            (vec![fake_grant4, fake_grant, fake_grant4], 2),
            (vec![fake_grant4 as Create; MAX_GIN_COMMS], 4),
        ] {
            let dcs: Vec<Vec<u64>> = creates.iter().map(|&c| setup(c, creates.len(), 0).unwrap()).collect();
            let comms: Vec<(&[u64], *mut c_void)> = dcs.iter().zip(&wins).map(|(d, &w)| (d.as_slice(), w)).collect();
            let desc = build_gin_net("test", &comms, DESC_BYTES).unwrap();
            assert_eq!(desc.len() * 8, l.bytes.div_ceil(8) * 8);
            let b = bytes_of(&desc);
            for (i, d) in dcs.iter().enumerate() {
                let at = i * l.stride;
                assert_eq!(&b[at..at + n], &bytes_of(d)[..n], "device comm {i}");
                // The grant is visible in the copied device comm: rank 1 of 4.
                assert_eq!((i32_at(&b, at), i32_at(&b, at + 4)), (1, 4));
                assert_eq!(u64::from_ne_bytes(b[at + l.win_off..at + l.win_off + 8].try_into().unwrap()), wins[i] as u64);
            }
            assert!(b[dcs.len() * l.stride..l.stride * l.capacity].iter().all(|&x| x == 0), "unused slots are zero");
            assert_eq!((i32_at(&b, l.comms_off), i32_at(&b, l.contexts_off)), (dcs.len() as i32, fewest));
        }
        let dc = setup(fake_grant, 1, 0).unwrap();
        let e = build_gin_net("test", &[(&dc, wins[0])], l.bytes - 1).unwrap_err().to_string();
        assert!(e.contains("reserved"), "{e}");
        assert!(build_gin_net("test", &[(&dc, std::ptr::null_mut())], DESC_BYTES).is_err());
        assert!(build_gin_net("test", &[], DESC_BYTES).is_err());
        assert!(build_gin_net("test", &vec![(dc.as_slice(), wins[0]); MAX_GIN_COMMS + 1], DESC_BYTES).is_err());
        assert!(build_gin_net("test", &[(&dc[..4], wins[0])], DESC_BYTES).unwrap_err().to_string().contains("failed"));
        // A device comm without GIN (0 contexts) makes no descriptor.
        let zero = vec![0u64; dc.len()];
        assert!(build_gin_net("test", &[(&dc, wins[0]), (&zero, wins[1])], DESC_BYTES).is_err());
    }

    #[test]
    fn device_route_is_the_host_route_and_units_cover_every_pair_once() {
        for comms in 1..=MAX_GIN_COMMS {
            for contexts in 1..=MAX_GIN_CONTEXTS {
                for unit in 0..100 {
                    assert_eq!(device_gin_route(unit, comms, contexts), route(unit, comms, contexts), "unit {unit}, {comms} x {contexts}");
                }
                // deep_ep::ll::clean_signals resets at(u) for u < units() = comms x contexts.
                let pairs: std::collections::HashSet<_> = (0..comms * contexts).map(|u| device_gin_route(u, comms, contexts)).collect();
                assert_eq!(pairs.len(), comms * contexts);
                assert!(pairs.iter().all(|&(k, c)| k < comms && c < contexts));
            }
        }
        // One communicator: the context is the unit modulo the contexts, as ncclGin reduces it.
        assert_eq!((0..6).map(|u| device_gin_route(u, 1, 3)).collect::<Vec<_>>(), vec![(0, 0), (0, 1), (0, 2), (0, 0), (0, 1), (0, 2)]);
    }

    #[test]
    fn teardown_destroys_device_comms_before_the_windows_and_the_communicators() {
        use gin_comms::Step::{Comm as XComm, Deregister as XDeregister, GinDevComm as XGin};
        use Teardown::*;
        assert_eq!(teardown_steps(0, true, true, true, true), vec![GinDevComm, DevComm, Deregister, MemFree, Comm]);
        assert_eq!(teardown_steps(0, false, true, true, true), vec![DevComm, Deregister, MemFree, Comm]);
        assert_eq!(teardown_steps(0, true, false, false, false), vec![GinDevComm, Comm]);
        // Two extra GIN communicators (DEEP_EP_GIN_COMMS = 3): every device comm, then every
        // registration of the memory, the memory, the extra communicators, the window's own.
        assert_eq!(
            teardown_steps(2, true, true, true, true),
            vec![
                Extra(XGin(1)),
                Extra(XGin(0)),
                GinDevComm,
                DevComm,
                Extra(XDeregister(1)),
                Extra(XDeregister(0)),
                Deregister,
                MemFree,
                Extra(XComm(1)),
                Extra(XComm(0)),
                Comm
            ]
        );
        // Creation failed after the split (no memory yet): the extras' steps are planned and
        // their missing resources skipped by GinComms::teardown.
        assert_eq!(
            teardown_steps(1, true, false, false, false),
            vec![Extra(XGin(0)), GinDevComm, Extra(XDeregister(0)), Extra(XComm(0)), Comm]
        );
    }
}
