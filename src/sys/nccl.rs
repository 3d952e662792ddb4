//! NCCL, loaded with `dlopen` at run time through bindings that build.rs generates from the
//! `nccl.h` of the build (bindgen, dynamic-loading mode). The library has no link-time NCCL
//! dependency: inside Python, torch has already loaded `libnccl.so.2`, and opening that soname
//! again returns the same copy.
//!
//! Calls go through `nccl_fn!`, which turns a symbol missing from the loaded library into an
//! [`Error::Device`] (the generated `NcclLib::ncclX` methods would panic instead: do not use them).
//!
//! Environment: `DEEP_EP_NCCL_LIBRARY` = path or soname to open instead of `libnccl.so.2`.

#[allow(non_upper_case_globals, non_camel_case_types, non_snake_case, dead_code, clippy::all, rustdoc::all, missing_docs)]
mod sys {
    include!(concat!(env!("OUT_DIR"), "/nccl_bindings.rs"));
}

pub use sys::*;

use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// Soname opened when `DEEP_EP_NCCL_LIBRARY` is unset (the only name the pip wheels ship).
pub const DEFAULT_LIBRARY: &str = "libnccl.so.2";

const OP: &str = "deep_ep::nccl";

// The unique id crosses torch as the backend-independent 128-byte id; the device API needs 2.28+.
const _: () = assert!(std::mem::size_of::<ncclUniqueId>() == super::UNIQUE_ID_BYTES);
const _: () = assert!(NCCL_HEADER_VERSION_CODE >= 22800, "NCCL headers older than 2.28 lack the device API");

static LIB: OnceLock<&'static NcclLib> = OnceLock::new();
static LOADING: Mutex<()> = Mutex::new(());

/// Resolves `$lib.$name` to its function pointer, or returns an [`Error::Device`] naming the
/// symbol from the enclosing function (which must return [`Result`]).
macro_rules! nccl_fn {
    ($lib:expr, $name:ident) => {
        match $lib.$name.as_ref() {
            Ok(f) => *f,
            Err(e) => {
                return Err($crate::error::Error::Device {
                    op: "deep_ep::nccl",
                    what: concat!("resolving ", stringify!($name)).to_string(),
                    detail: format!("symbol missing from the loaded NCCL library: {e}"),
                })
            }
        }
    };
}
#[allow(unused_imports)] // the macro is used by textual scope here; the re-export serves the backend
pub(crate) use nccl_fn;

/// Opens `path` (a file path or a soname) as NCCL. Every symbol is optional: a missing one is
/// reported when it is first used through `nccl_fn!`.
///
/// The library is never closed: NCCL starts threads (the bootstrap root of `ncclGetUniqueId`,
/// proxies) that run its code until the process exits, and unloading it under them crashes.
/// Opening the same file again returns the already-loaded copy (one more leaked handle).
pub fn open(path: &str) -> Result<&'static NcclLib> {
    // SAFETY: loading runs libnccl's initialisers, which only set up its own state; NCCL is
    // designed to be dlopen'ed (torch does the same).
    let lib = unsafe { NcclLib::new(path) }.map_err(|e| Error::Device {
        op: OP,
        what: format!("loading NCCL from {path:?}"),
        detail: format!("{e} (set DEEP_EP_NCCL_LIBRARY to the path of libnccl.so.2, or import torch first)"),
    })?;
    Ok(Box::leak(Box::new(lib)))
}

/// The process-wide NCCL, opened on first use (`DEEP_EP_NCCL_LIBRARY`, else `libnccl.so.2`).
/// A failed load is not cached, so a later call may succeed (e.g. after `import torch`).
pub fn library() -> Result<&'static NcclLib> {
    if let Some(lib) = LIB.get() {
        return Ok(*lib);
    }
    // One loader at a time, so the library is opened once; a poisoned lock only means another
    // loader panicked, which leaves nothing half-initialised here.
    let _guard = LOADING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(lib) = LIB.get() {
        return Ok(*lib);
    }
    let lib = open(&library_path())?;
    Ok(*LIB.get_or_init(|| lib))
}

/// What [`library`] opens: `DEEP_EP_NCCL_LIBRARY`, else [`DEFAULT_LIBRARY`].
fn library_path() -> String {
    std::env::var("DEEP_EP_NCCL_LIBRARY").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| DEFAULT_LIBRARY.to_string())
}

/// The host functions of NCCL's device API that `nccl.h` does not declare (they live in the C++
/// header `nccl_device/core.h`), as raw addresses for the C glue in `kernels/nccl_glue.cu`.
pub struct DeviceApi {
    /// `ncclDevCommCreate(ncclComm_t, const ncclDevCommRequirements_t*, ncclDevComm_t*)`.
    pub dev_comm_create: *mut c_void,
    /// `ncclDevCommDestroy(ncclComm_t, const ncclDevComm_t*)`.
    pub dev_comm_destroy: *mut c_void,
}

// SAFETY: two immutable code addresses of a library that is never unloaded.
unsafe impl Send for DeviceApi {}
unsafe impl Sync for DeviceApi {}

static DEVICE_API: OnceLock<DeviceApi> = OnceLock::new();

/// Resolves the device-API host functions from the same library as [`library`] (opening it again
/// returns the loaded copy; the handle is leaked like the first one).
pub fn device_api() -> Result<&'static DeviceApi> {
    if let Some(api) = DEVICE_API.get() {
        return Ok(api);
    }
    let path = library_path();
    let fail = |what: &str, e: String| Error::Device { op: OP, what: what.to_string(), detail: format!("{e} (NCCL {path:?})") };
    // SAFETY: the library is already loaded by `library()`; loading runs no new initialisers.
    let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| fail("loading NCCL for the device API", e.to_string()))?;
    let sym = |name: &[u8]| -> Result<*mut c_void> {
        // SAFETY: a `*mut c_void` symbol is the address of the function; it is only called by the
        // glue with the prototype of nccl_device/core.h.
        let s = unsafe { lib.get::<*mut c_void>(name) }.map_err(|e| fail("resolving the NCCL device API", e.to_string()))?;
        Ok(*s)
    };
    let api = DeviceApi { dev_comm_create: sym(b"ncclDevCommCreate\0")?, dev_comm_destroy: sym(b"ncclDevCommDestroy\0")? };
    std::mem::forget(lib); // never unloaded (see `open`)
    Ok(DEVICE_API.get_or_init(|| api))
}

/// Turns an `ncclResult_t` into `Ok` or an [`Error::Device`] with NCCL's own error text.
pub fn check(lib: &NcclLib, res: ncclResult_t, what: &str) -> Result<()> {
    if res == ncclResult_t::ncclSuccess {
        return Ok(());
    }
    Err(Error::Device { op: OP, what: what.to_string(), detail: format!("ncclResult_t {} {}", res.0, error_text(lib, res.0 as i32)) })
}

/// NCCL's text for a result code (`ncclGetErrorString`; empty when the symbol is missing).
pub fn error_text(lib: &NcclLib, code: i32) -> String {
    match lib.ncclGetErrorString.as_ref() {
        // SAFETY: ncclGetErrorString returns a static string for any value.
        Ok(f) => {
            let p = unsafe { f(ncclResult_t(code as _)) };
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null static NUL-terminated string owned by NCCL.
                unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        }
        Err(_) => String::new(),
    }
}

/// `"2.28.9"` for a version code (`major*10000 + minor*100 + patch` since NCCL 2.9).
pub fn version_string(code: i32) -> String {
    if code >= 20900 {
        format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100)
    }
}

/// The runtime NCCL version code (`ncclGetVersion`).
pub fn runtime_version(lib: &NcclLib) -> Result<i32> {
    let get_version = nccl_fn!(lib, ncclGetVersion);
    let mut v: std::os::raw::c_int = 0;
    // SAFETY: writes one int through a valid pointer.
    check(lib, unsafe { get_version(&mut v) }, "ncclGetVersion")?;
    Ok(v)
}

/// Requires the runtime NCCL to be exactly the version of the headers the crate was built with
/// ([`NCCL_HEADER_VERSION_CODE`]) and returns it. Before NCCL 2.31 the device-API structs
/// (`ncclDevComm`, requirements) have no version field, so any mismatch could corrupt memory.
pub fn check_version(lib: &NcclLib) -> Result<i32> {
    let v = runtime_version(lib)?;
    if v != NCCL_HEADER_VERSION_CODE {
        return Err(Error::Device {
            op: OP,
            what: "NCCL version check".into(),
            detail: format!(
                "the loaded NCCL is {} ({v}) but deep_ep was built against NCCL {} headers ({}); the device-API \
                 structs differ between versions. Use the NCCL of the build (pip nvidia-nccl-cu13=={}, or \
                 DEEP_EP_NCCL_LIBRARY) or rebuild deep_ep with NCCL_HOME pointing at the runtime's NCCL",
                version_string(v),
                version_string(NCCL_HEADER_VERSION_CODE),
                NCCL_HEADER_VERSION_CODE,
                version_string(NCCL_HEADER_VERSION_CODE),
            ),
        });
    }
    Ok(v)
}

/// A fresh `ncclUniqueId` (128 bytes) from `ncclGetUniqueId`; host only, needs no GPU.
pub fn unique_id(lib: &NcclLib) -> Result<[u8; std::mem::size_of::<ncclUniqueId>()]> {
    let get_id = nccl_fn!(lib, ncclGetUniqueId);
    let mut id = ncclUniqueId::default();
    // SAFETY: writes one ncclUniqueId through a valid pointer.
    check(lib, unsafe { get_id(&mut id) }, "ncclGetUniqueId")?;
    let mut out = [0u8; std::mem::size_of::<ncclUniqueId>()];
    for (o, c) in out.iter_mut().zip(id.internal.iter()) {
        *o = *c as u8;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_layout_matches_the_wire_format() {
        assert_eq!(std::mem::size_of::<ncclUniqueId>(), 128);
        assert_eq!(version_string(22809), "2.28.9");
    }

    #[test]
    fn loaded_library_matches_the_headers() {
        let Some(path) = crate::sys::test_library("DEEP_EP_NCCL_LIBRARY", option_env!("DEEP_EP_BUILD_NCCL_HOME"), "libnccl.so.2") else {
            return;
        };
        let lib = open(&path).expect("open libnccl.so.2");
        assert_eq!(runtime_version(lib).expect("ncclGetVersion"), NCCL_HEADER_VERSION_CODE);
        assert_eq!(check_version(lib).expect("version"), NCCL_HEADER_VERSION_CODE);
        let e = check(lib, ncclResult_t::ncclInvalidArgument, "ncclX").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.starts_with("deep_ep::nccl: ncclX failed: ncclResult_t 4"), "{e}");
        // Host-only bootstrap: works without a GPU where a network interface exists.
        match unique_id(lib) {
            Ok(id) => assert!(id.iter().any(|&b| b != 0)),
            Err(e) => eprintln!("ncclGetUniqueId unavailable here: {e}"),
        }
    }

    #[test]
    fn missing_library_is_an_error() {
        let e = open("/nonexistent/libnccl.so.2").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("loading NCCL") && e.contains("DEEP_EP_NCCL_LIBRARY"), "{e}");
    }
}
