//! Ctrl-C during a host wait. In a Python process SIGINT only sets the interpreter's flag, which
//! Python acts on when the op returns: a rank waiting for a dead peer would ignore Ctrl-C until
//! `DEEP_EP_TIMEOUT_MS` ran out (100 s by default). Host waits ask [`requested`] every
//! [`CHECK_EVERY`]; it looks the flag up through the CPython C API of the running process (found
//! with `dlsym`, so the library links no Python and a C++ or Rust host, which has none, is never
//! affected), consumes it and sets it again (`PyErr_SetInterrupt`), so the wait returns an error
//! and Python raises `KeyboardInterrupt` as soon as the op has returned.
//!
//! Only the process's main thread looks: CPython delivers SIGINT there alone, so another thread
//! could never see the flag, and taking the GIL from it is harmful. At interpreter exit, a
//! daemon thread that asks for the GIL is ended by CPython with `pthread_exit`, whose forced
//! unwind would reach the C seam's `catch_unwind` (`api::buffer::guard`) and abort the process
//! ("FATAL: exception not rethrown"). Nothing here may start such an unwind: a forced unwind
//! must never be caught, and the library has no way to let one pass through its seam.

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How often a waiting thread looks at the interpreter's flag (one GIL acquisition each).
pub const CHECK_EVERY: Duration = Duration::from_millis(20);

struct Python {
    is_initialized: unsafe extern "C" fn() -> c_int,
    is_finalizing: Option<unsafe extern "C" fn() -> c_int>,
    gil_ensure: unsafe extern "C" fn() -> c_int,
    gil_release: unsafe extern "C" fn(c_int),
    interrupt_occurred: unsafe extern "C" fn() -> c_int,
    set_interrupt: unsafe extern "C" fn(),
}

fn symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym over the symbols already loaded in the process; a null result is handled.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

fn python() -> Option<&'static Python> {
    static PY: OnceLock<Option<Python>> = OnceLock::new();
    PY.get_or_init(|| {
        // SAFETY: each pointer is the CPython function of that name, whose C signature is the one
        // transmuted to (stable ABI: Py_IsInitialized, PyGILState_Ensure/Release,
        // PyOS_InterruptOccurred, PyErr_SetInterrupt; _Py_IsFinalizing has had it since 3.7).
        unsafe {
            Some(Python {
                is_initialized: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(symbol(c"Py_IsInitialized")?),
                is_finalizing: symbol(c"_Py_IsFinalizing")
                    .or_else(|| symbol(c"Py_IsFinalizing"))
                    .map(|p| std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(p)),
                gil_ensure: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(symbol(c"PyGILState_Ensure")?),
                gil_release: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(symbol(c"PyGILState_Release")?),
                interrupt_occurred: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(symbol(c"PyOS_InterruptOccurred")?),
                set_interrupt: std::mem::transmute::<*mut c_void, unsafe extern "C" fn()>(symbol(c"PyErr_SetInterrupt")?),
            })
        }
    })
    .as_ref()
}

/// Whether the calling thread is the process's main thread (the one CPython runs its signal
/// handlers on, and the one that finalises the interpreter).
fn on_main_thread() -> bool {
    // SAFETY: gettid and getpid take no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) == libc::getpid() as libc::c_long }
}

/// Whether the user asked to interrupt (SIGINT seen by the Python interpreter of this process).
/// Answered on the main thread only (Python handles signals there; see the module docs for why
/// other threads must not take the GIL); elsewhere always false. The flag is set again before
/// returning true, so Python still raises `KeyboardInterrupt` once the op returns.
pub fn requested() -> bool {
    if !on_main_thread() {
        return false;
    }
    let Some(py) = python() else { return false };
    // SAFETY: the CPython calls are made only on the main thread (which CPython never ends),
    // while the interpreter is initialised and not finalising; PyGILState_Ensure/Release pair up
    // on this thread (re-entrant when it already holds the GIL), and PyOS_InterruptOccurred needs
    // the GIL, which is held around it.
    unsafe {
        if (py.is_initialized)() == 0 || py.is_finalizing.is_some_and(|f| f() != 0) {
            return false;
        }
        let gil = (py.gil_ensure)();
        let hit = (py.interrupt_occurred)() != 0;
        (py.gil_release)(gil);
        if hit {
            (py.set_interrupt)();
        }
        hit
    }
}

/// [`requested`] at most every [`CHECK_EVERY`] of a wait that began at `start`; `last` keeps the
/// time of the previous check.
pub fn requested_during(last: &mut Instant) -> bool {
    if last.elapsed() < CHECK_EVERY {
        return false;
    }
    *last = Instant::now();
    requested()
}
