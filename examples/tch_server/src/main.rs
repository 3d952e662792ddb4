//! Serves a TorchScript MoE step made by another (Python) process (tests/python/_serialized_model.py):
//! loads libdeep_ep.so (registers `deep_ep::*` and exports its C API), creates this process's own
//! buffer on the device the model was made for (CPU backend, or cuda:N with the default GPU
//! backend), binds it to slot 0 (the slot the model was made with), loads the model with
//! `tch::CModule`, runs it on the saved inputs and checks prefill and decode bit for bit.

use anyhow::{bail, ensure, Context, Result};
use std::ffi::{c_char, c_int, CStr};
use tch::{CModule, IValue, Tensor};

/// The parts of libdeep_ep.so's C API (csrc/deep_ep_capi.h) this server calls.
struct DeepEp {
    lib: libloading::Library,
}

type GetUniqueId = unsafe extern "C" fn(*const c_char, i32, *mut u8) -> c_int;
type CreateBuffer = unsafe extern "C" fn(*const u8, i64, i64, i64, i32, i64, i64, i32, *const c_char, *mut i64) -> c_int;
type BindSlot = unsafe extern "C" fn(i64, i64) -> c_int;
type DestroyBuffer = unsafe extern "C" fn(i64) -> c_int;
type LlHint = unsafe extern "C" fn(i64, i64, i64, i64, *mut i64) -> c_int;
type LastError = unsafe extern "C" fn() -> *const c_char;

impl DeepEp {
    fn load(path: &str) -> Result<Self> {
        // SAFETY: loading runs the library's static initialisers, which register its torch ops
        // with the libtorch that tch already loaded (the library links the same libtorch_cpu).
        let lib = unsafe { libloading::Library::new(path) }.with_context(|| format!("cannot load {path}"))?;
        Ok(DeepEp { lib })
    }

    fn sym<T: Copy>(&self, name: &[u8]) -> Result<T> {
        // SAFETY: each alias above matches the declaration in csrc/deep_ep_capi.h.
        Ok(*unsafe { self.lib.get::<T>(name) }.with_context(|| format!("symbol {}", String::from_utf8_lossy(name)))?)
    }

    fn check(&self, status: c_int) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        let last: LastError = self.sym(b"deep_ep_last_error")?;
        // SAFETY: a NUL-terminated message owned by the library, valid until the next call.
        bail!("{}", unsafe { CStr::from_ptr(last()) }.to_string_lossy())
    }

    /// A one-rank buffer (collective of one) on `device` (-1 = CPU, else a CUDA index) with room
    /// for LL calls of `t` tokens: the cpu backend, or on a GPU the default (DEEP_EP_BACKEND, else nccl).
    fn create_buffer(&self, device: i32, nvl_bytes: i64, t: i64, hidden: i64, experts: i64) -> Result<i64> {
        let (uid_fn, create, hint): (GetUniqueId, CreateBuffer, LlHint) =
            (self.sym(b"deep_ep_get_unique_id")?, self.sym(b"deep_ep_create_buffer")?, self.sym(b"deep_ep_low_latency_rdma_size_hint")?);
        let backend = if device < 0 { c"cpu" } else { c"" };
        let (mut uid, mut rdma, mut handle) = ([0u8; 128], 0i64, 0i64);
        // SAFETY: out-pointers to locals of the sizes the C API writes.
        unsafe {
            self.check(uid_fn(backend.as_ptr(), device, uid.as_mut_ptr()))?;
            self.check(hint(t, hidden, 1, experts, &mut rdma))?;
            self.check(create(uid.as_ptr(), 128, 0, 1, device, nvl_bytes, rdma, 1, backend.as_ptr(), &mut handle))?;
        }
        Ok(handle)
    }

    fn bind_slot(&self, handle: i64, slot: i64) -> Result<()> {
        let bind: BindSlot = self.sym(b"deep_ep_bind_buffer_slot")?;
        // SAFETY: plain integers.
        self.check(unsafe { bind(handle, slot) })
    }

    fn destroy(&self, handle: i64) -> Result<()> {
        let destroy: DestroyBuffer = self.sym(b"deep_ep_destroy_buffer")?;
        // SAFETY: plain integer.
        self.check(unsafe { destroy(handle) })
    }
}

fn tensors(v: IValue, what: &str) -> Result<Vec<Tensor>> {
    match v {
        IValue::Tuple(items) => items
            .into_iter()
            .map(|i| match i {
                IValue::Tensor(t) => Ok(t),
                other => bail!("{what}: expected tensors, got {other:?}"),
            })
            .collect(),
        other => bail!("{what}: expected a tuple, got {other:?}"),
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let dir = arg("--dir").context("usage: deep_ep_tch_server --dir DIR [--lib libdeep_ep.so]")?;
    let lib = arg("--lib").unwrap_or_else(|| "target/release/libdeep_ep.so".into());

    // A CUDA libtorch registers its CUDA kernels from libtorch_cuda.so, which the linker drops from
    // this binary (nothing here names a symbol of it): load it by name, so models and tensors saved
    // on a GPU load here. Absent (a CPU-only libtorch): CPU only.
    // SAFETY: loading runs libtorch_cuda's static initialisers against the libtorch tch loaded.
    let _cuda = unsafe { libloading::Library::new("libtorch_cuda.so") }.ok();
    let deep_ep = DeepEp::load(&lib)?; // before loading any model that calls deep_ep::*
                                       // Saved inputs and outputs (io_ts.pt's forward returns them).
                                       // io_ts.pt's forward returns [num_inputs, *inputs, prefill, decode, num_experts, max_decode_tokens].
    let no_args: [IValue; 0] = [];
    let saved = match CModule::load(format!("{dir}/io_ts.pt"))?.forward_is(&no_args)? {
        IValue::TensorList(v) => v,
        other => bail!("io_ts.pt: expected a list of tensors, got {other:?}"),
    };
    let n_in = saved.first().context("io_ts.pt returned nothing")?.int64_value(&[]) as usize;
    ensure!(saved.len() == n_in + 5, "io_ts.pt returned {} tensors, expected {}", saved.len(), n_in + 5);
    let (inputs, want) = (&saved[1..1 + n_in], &saved[1 + n_in..3 + n_in]);
    let (n, hidden) = (inputs[0].size()[0], inputs[0].size()[1]);
    let (experts, t) = (saved[3 + n_in].int64_value(&[]), saved[4 + n_in].int64_value(&[]));
    let device = match inputs[0].device() {
        tch::Device::Cuda(i) => i as i32,
        _ => -1,
    };
    let other = deep_ep.create_buffer(device, 1 << 20, t, hidden, experts)?; // handles differ from the maker's
    let handle = deep_ep.create_buffer(device, 1 << 22, t, hidden, experts)?;
    deep_ep.bind_slot(handle, 0)?;
    println!("buffers {other} and {handle} on {:?}, slot 0 -> {handle}; {n} tokens x {hidden}", inputs[0].device());

    let model = CModule::load(format!("{dir}/model.pt")).context("loading the TorchScript model")?;
    let args: Vec<IValue> = inputs.iter().map(|t| IValue::Tensor(t.shallow_clone())).collect();
    let out = tensors(model.forward_is(&args)?, "model.pt")?;
    ensure!(out.len() == 2, "the model returned {} tensors, expected (prefill, decode)", out.len());
    for (name, got, want) in [("prefill", &out[0], &want[0]), ("decode", &out[1], &want[1])] {
        ensure!(got.kind() == want.kind() && got.equal(want), "{name} differs from the saved output");
        println!("{name}: bit-exact with the saved output");
    }
    deep_ep.destroy(handle)?;
    deep_ep.destroy(other)?;
    println!("tch_server: all checks passed");
    Ok(())
}
