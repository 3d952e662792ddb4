//! NVSHMEM's host library (`libnvshmem_host.so.3`), loaded with `dlopen` at run time, so the
//! crate builds and loads without NVSHMEM. Inside Python, a CUDA torch has already loaded the
//! library (its `libtorch_nvshmem.so` needs it) and opening the soname returns that copy.
//!
//! Only the host-only part of NVSHMEM is used (`nvshmemx_hostlib_init_attr`, no device library
//! linked): the symmetric heap, `nvshmem_ptr` for the peers' addresses, host barriers. The few
//! declarations below mirror NVSHMEM 3's headers (`host/nvshmemx_api.h`,
//! `device_host/nvshmem_types.h`, `bootstrap_device_host/nvshmem_uniqueid.h`); their structs are
//! versioned by NVSHMEM itself (`(1 << 16) + sizeof`), so any NVSHMEM 3.x accepts them and a
//! different major version is refused by [`check_version`].
//!
//! Environment: `DEEP_EP_NVSHMEM_LIBRARY` = path or soname to open instead of
//! `libnvshmem_host.so.3`.

use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

/// Soname opened when `DEEP_EP_NVSHMEM_LIBRARY` is unset (the pip wheel `nvidia-nvshmem-cu13`).
pub const DEFAULT_LIBRARY: &str = "libnvshmem_host.so.3";
/// The NVSHMEM major version whose init ABI is declared here.
pub const MAJOR: i32 = 3;
/// `NVSHMEMX_INIT_WITH_UNIQUEID`.
const INIT_WITH_UNIQUEID: c_uint = 1 << 3;

const OP: &str = "deep_ep::nvshmem";

/// `nvshmemx_uniqueid_v1`: 128 bytes, the backend-independent unique id on the wire.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct UniqueId {
    pub version: c_int,
    pub internal: [c_char; 124],
}

/// `nvshmemx_uniqueid_args_v1`.
#[repr(C)]
struct UniqueIdArgs {
    version: c_int,
    id: *mut UniqueId,
    myrank: c_int,
    nranks: c_int,
}

/// `nvshmemx_init_args_v1`.
#[repr(C)]
struct InitArgs {
    version: c_int,
    uid_args: UniqueIdArgs,
    content: [c_char; 96],
}

/// `nvshmemx_init_attr_v1`.
#[repr(C)]
struct InitAttr {
    version: c_int,
    mpi_comm: *mut c_void,
    args: InitArgs,
}

// The headers' own static_asserts.
const _: () = assert!(std::mem::size_of::<UniqueId>() == 128 && std::mem::size_of::<UniqueId>() == super::UNIQUE_ID_BYTES);
const _: () = assert!(std::mem::size_of::<UniqueIdArgs>() == 24);
const _: () = assert!(std::mem::size_of::<InitArgs>() == 128);
const _: () = assert!(std::mem::size_of::<InitAttr>() == 144);

/// `(1 << 16) + sizeof(T)`: how NVSHMEM versions its structs.
const fn struct_version<T>() -> c_int {
    (1 << 16) + std::mem::size_of::<T>() as c_int
}

/// The host functions the backend calls, resolved once from the loaded library.
pub struct NvshmemLib {
    path: String,
    vendor_version: unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int),
    get_uniqueid: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    set_attr_uniqueid_args: unsafe extern "C" fn(c_int, c_int, *const UniqueId, *mut InitAttr) -> c_int,
    hostlib_init_attr: unsafe extern "C" fn(c_uint, *mut InitAttr) -> c_int,
    hostlib_finalize: unsafe extern "C" fn(),
    my_pe: unsafe extern "C" fn() -> c_int,
    n_pes: unsafe extern "C" fn() -> c_int,
    malloc: unsafe extern "C" fn(usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void),
    ptr: unsafe extern "C" fn(*const c_void, c_int) -> *mut c_void,
    barrier_all: unsafe extern "C" fn(),
    /// `nvshmemx_cumodule_init` / `_finalize`, as opaque pointers: handed to the device transport
    /// (kernels/nvshmem/transport.cu), which passes them this library's CUDA module.
    cumodule_init: *mut c_void,
    cumodule_finalize: *mut c_void,
}

// SAFETY: the two raw pointers are function addresses of the leaked (never unloaded) library.
unsafe impl Send for NvshmemLib {}
// SAFETY: as above; nothing is mutated through them.
unsafe impl Sync for NvshmemLib {}

static LIB: OnceLock<&'static NvshmemLib> = OnceLock::new();
static LOADING: Mutex<()> = Mutex::new(());

fn load_error(path: &str, e: impl std::fmt::Display) -> Error {
    Error::Device {
        op: OP,
        what: format!("loading NVSHMEM from {path:?}"),
        detail: format!(
            "{e} (the nvshmem backend needs NVSHMEM {MAJOR}.x: pip install nvidia-nvshmem-cu13, then set \
             DEEP_EP_NVSHMEM_LIBRARY to <site-packages>/nvidia/nvshmem/lib/libnvshmem_host.so.3, or import a CUDA torch first)"
        ),
    }
}

/// Opens `path` (a file path or a soname) as NVSHMEM's host library and resolves every symbol
/// the backend uses. Never closed: NVSHMEM keeps threads and CUDA state until the process exits.
pub fn open(path: &str) -> Result<&'static NvshmemLib> {
    // SAFETY: loading runs libnvshmem_host's initialisers, which only set up its own state; the
    // library is meant to be dlopen'ed (torch and nvshmem4py do the same).
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| load_error(path, e))?;
    macro_rules! sym {
        ($name:literal) => {
            symbol(&lib, path, concat!($name, "\0"))?
        };
    }
    let l = NvshmemLib {
        path: path.to_string(),
        vendor_version: sym!("nvshmemx_vendor_get_version_info"),
        get_uniqueid: sym!("nvshmemx_get_uniqueid"),
        set_attr_uniqueid_args: sym!("nvshmemx_set_attr_uniqueid_args"),
        hostlib_init_attr: sym!("nvshmemx_hostlib_init_attr"),
        hostlib_finalize: sym!("nvshmemx_hostlib_finalize"),
        my_pe: sym!("nvshmem_my_pe"),
        n_pes: sym!("nvshmem_n_pes"),
        malloc: sym!("nvshmem_malloc"),
        free: sym!("nvshmem_free"),
        ptr: sym!("nvshmem_ptr"),
        barrier_all: sym!("nvshmem_barrier_all"),
        cumodule_init: symbol::<unsafe extern "C" fn()>(&lib, path, "nvshmemx_cumodule_init\0")? as *mut c_void,
        cumodule_finalize: symbol::<unsafe extern "C" fn()>(&lib, path, "nvshmemx_cumodule_finalize\0")? as *mut c_void,
    };
    std::mem::forget(lib);
    Ok(Box::leak(Box::new(l)))
}

/// Resolves `name` (NUL-terminated) as a `T` (a function pointer of NVSHMEM 3's prototype).
fn symbol<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> Result<T> {
    // SAFETY: every caller declares `T` with the prototype of NVSHMEM 3's headers; the library is
    // leaked by `open`, so the pointer stays valid for the process.
    let s = unsafe { lib.get::<T>(name.as_bytes()) };
    let shown = name.trim_end_matches('\0');
    s.map(|s| *s).map_err(|e| load_error(path, format!("symbol {shown} missing, not an NVSHMEM {MAJOR} host library: {e}")))
}

/// The process-wide NVSHMEM, opened on first use (`DEEP_EP_NVSHMEM_LIBRARY`, else
/// [`DEFAULT_LIBRARY`]) and checked with [`check_version`]. A failed load is not cached.
pub fn library() -> Result<&'static NvshmemLib> {
    if let Some(lib) = LIB.get() {
        return Ok(*lib);
    }
    let _guard = LOADING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(lib) = LIB.get() {
        return Ok(*lib);
    }
    let path = std::env::var("DEEP_EP_NVSHMEM_LIBRARY").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| DEFAULT_LIBRARY.to_string());
    let lib = open(&path)?;
    check_version(lib)?;
    Ok(*LIB.get_or_init(|| lib))
}

/// Why `version` cannot be used, if it cannot.
pub fn version_problem(version: (i32, i32, i32)) -> Option<String> {
    let (major, minor, patch) = version;
    (major != MAJOR).then(|| {
        format!(
            "the loaded NVSHMEM is {major}.{minor}.{patch}, but deep_ep's nvshmem backend declares the init ABI of \
             NVSHMEM {MAJOR}.x (nvshmemx_init_attr_v1); install nvidia-nvshmem-cu13 {MAJOR}.x or point DEEP_EP_NVSHMEM_LIBRARY at one"
        )
    })
}

/// Refuses a library whose version [`version_problem`] rejects.
pub fn check_version(lib: &NvshmemLib) -> Result<()> {
    match version_problem(lib.version()) {
        None => Ok(()),
        Some(why) => Err(Error::Device { op: OP, what: format!("NVSHMEM version check ({})", lib.path()), detail: why }),
    }
}

impl NvshmemLib {
    /// `(major, minor, patch)` of the loaded library.
    pub fn version(&self) -> (i32, i32, i32) {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: writes three ints through valid pointers.
        unsafe { (self.vendor_version)(&mut a, &mut b, &mut c) };
        (a, b, c)
    }

    /// The path or soname it was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// A fresh unique id from `nvshmemx_get_uniqueid` (host only; rank 0 of a buffer).
    pub fn unique_id(&self) -> Result<[u8; 128]> {
        let mut id = UniqueId { version: struct_version::<UniqueId>(), internal: [0; 124] };
        // SAFETY: writes one nvshmemx_uniqueid_t through a valid pointer.
        let st = unsafe { (self.get_uniqueid)(&mut id) };
        check(st, "nvshmemx_get_uniqueid")?;
        Ok(to_bytes(&id))
    }

    /// `nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID)` as `rank` of `num_ranks` on the
    /// current CUDA device; collective over the ranks that share `id`.
    pub fn init(&self, id: &[u8; 128], rank: usize, num_ranks: usize) -> Result<()> {
        let uid = from_bytes(id);
        // SAFETY: zero is a valid value for every field (null pointers, zero ints).
        let mut attr: InitAttr = unsafe { std::mem::zeroed() };
        // What nvshmemx_init_init_attr_ver_only does.
        attr.version = struct_version::<InitAttr>();
        attr.args.version = struct_version::<InitArgs>();
        attr.args.uid_args.version = struct_version::<UniqueIdArgs>();
        // SAFETY: stores a pointer to `uid` (alive until init returns) and the two ints in `attr`.
        let st = unsafe { (self.set_attr_uniqueid_args)(rank as c_int, num_ranks as c_int, &uid, &mut attr) };
        check(st, "nvshmemx_set_attr_uniqueid_args")?;
        // SAFETY: `attr` is fully versioned and points to `uid`, both alive for the call.
        let st = unsafe { (self.hostlib_init_attr)(INIT_WITH_UNIQUEID, &mut attr) };
        check(st, "nvshmemx_hostlib_init_attr (NVSHMEM initialisation; NVSHMEM_DEBUG=INFO tells why)")
    }

    /// `(nvshmem_my_pe(), nvshmem_n_pes())` of the initialised library.
    pub fn pe(&self) -> (i32, i32) {
        // SAFETY: plain queries; valid after init.
        unsafe { ((self.my_pe)(), (self.n_pes)()) }
    }

    /// `nvshmem_malloc` (collective, same size on every rank); null when the heap is too small.
    pub fn malloc(&self, bytes: usize) -> *mut c_void {
        // SAFETY: plain allocation call of the initialised library.
        unsafe { (self.malloc)(bytes) }
    }

    /// `nvshmem_free` (collective).
    ///
    /// # Safety
    /// `p` came from [`Self::malloc`] of this library, is freed once, and no kernel uses it.
    pub unsafe fn free(&self, p: *mut c_void) {
        // SAFETY: the caller's contract.
        unsafe { (self.free)(p) }
    }

    /// `nvshmem_ptr(p, pe)`: `pe`'s copy of the symmetric address `p` as a pointer this GPU can
    /// load and store through (peer mapping), or null when `pe` is not reachable that way.
    #[allow(clippy::not_unsafe_ptr_arg_deref)] // `p` is only translated by NVSHMEM, never dereferenced
    pub fn peer_ptr(&self, p: *const c_void, pe: usize) -> *mut c_void {
        // SAFETY: address translation only; `p` is a symmetric address of the live heap.
        unsafe { (self.ptr)(p, pe as c_int) }
    }

    /// `nvshmem_barrier_all` (collective, host-blocking; completes earlier stores).
    pub fn barrier_all(&self) {
        // SAFETY: plain collective call of the initialised library.
        unsafe { (self.barrier_all)() }
    }

    /// Registers (`init`) or unregisters this library's NVSHMEM device state with the initialised
    /// library (`nvshmemx_cumodule_init` / `_finalize` on the CUDA module of the device
    /// transport), so that device-side NVSHMEM calls of kernels/nvshmem/ work. Current device.
    pub fn register_device_state(&self, op: &'static str, init: bool) -> Result<()> {
        let f = if init { self.cumodule_init } else { self.cumodule_finalize };
        // SAFETY: `f` is the named function of this library, which the caller initialised.
        unsafe { crate::kernels::transport::nvshmem_device_register(op, f, init) }
    }

    /// `nvshmemx_hostlib_finalize` (collective).
    pub fn finalize(&self) {
        // SAFETY: called once per successful init, after the heap allocations are freed.
        unsafe { (self.hostlib_finalize)() }
    }
}

fn check(status: c_int, what: &str) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    Err(Error::Device { op: OP, what: what.to_string(), detail: format!("NVSHMEM status {status}") })
}

fn to_bytes(id: &UniqueId) -> [u8; 128] {
    let mut out = [0u8; 128];
    out[..4].copy_from_slice(&id.version.to_ne_bytes());
    for (o, c) in out[4..].iter_mut().zip(id.internal.iter()) {
        *o = *c as u8;
    }
    out
}

fn from_bytes(b: &[u8; 128]) -> UniqueId {
    let mut id = UniqueId { version: c_int::from_ne_bytes([b[0], b[1], b[2], b[3]]), internal: [0; 124] };
    for (d, s) in id.internal.iter_mut().zip(b[4..].iter()) {
        *d = *s as c_char;
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_round_trips_through_bytes() {
        let mut b = [0u8; 128];
        b.iter_mut().enumerate().for_each(|(i, v)| *v = (i * 7 + 3) as u8);
        assert_eq!(to_bytes(&from_bytes(&b)), b);
        assert_eq!(struct_version::<InitAttr>(), (1 << 16) + 144);
    }

    #[test]
    fn versions_other_than_3_are_refused() {
        assert_eq!(version_problem((3, 4, 5)), None);
        assert_eq!(version_problem((3, 0, 6)), None);
        let e = version_problem((2, 11, 0)).unwrap_or_default();
        assert!(e.contains("the loaded NVSHMEM is 2.11.0") && e.contains("NVSHMEM 3.x"), "{e}");
    }

    #[test]
    fn missing_library_is_a_clear_error() {
        let e = open("/nonexistent/libnvshmem_host.so.3").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.starts_with("deep_ep::nvshmem: loading NVSHMEM from \"/nonexistent/libnvshmem_host.so.3\" failed"), "{e}");
        assert!(e.contains("DEEP_EP_NVSHMEM_LIBRARY") && e.contains("nvidia-nvshmem-cu13"), "{e}");
    }

    #[test]
    fn wheel_library_resolves_every_symbol() {
        let Some(path) =
            crate::sys::test_library("DEEP_EP_NVSHMEM_LIBRARY", option_env!("DEEP_EP_BUILD_NVSHMEM_HOME"), "libnvshmem_host.so.3")
        else {
            return;
        };
        let lib = open(&path).expect("open libnvshmem_host.so.3");
        let v = lib.version();
        assert_eq!(version_problem(v), None, "{v:?}");
        assert_eq!(lib.path(), path);
        // Host-only bootstrap: rank 0's id, where a network interface exists.
        match lib.unique_id() {
            Ok(id) => assert!(id[4..].iter().any(|&b| b != 0) && from_bytes(&id).version == struct_version::<UniqueId>(), "{:?}", &id[..8]),
            Err(e) => eprintln!("nvshmemx_get_uniqueid unavailable here: {e}"),
        }
    }
}
