// Helpers shared by the op implementations: tensor → deep_ep_tensor_t, status → RuntimeError,
// the stream to launch on. The only torch-aware code besides the Python package.
//
// Everything here uses libtorch's stable ABI only (torch/csrc/stable, the C shim; target 2.10 via
// TORCH_TARGET_VERSION set by build.rs), so one build of the library loads into any torch >= 2.10
// (docs/BUILD.md, "One binary across torch versions").
#pragma once
#include <dlfcn.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
#include "deep_ep_capi.h"

namespace deep_ep_ops {

using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using ScalarType = torch::headeronly::ScalarType;
using DeviceType = torch::headeronly::DeviceType;
/// int[] arguments arrive as a vector (the stable boxing owns them).
using IntList = std::vector<int64_t>;

// Streams every argument into one message and raises it (RuntimeError in Python).
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  throw std::runtime_error(s.str());
}

#define DEEP_EP_CHECK(cond, ...) \
  if (!(cond)) ::deep_ep_ops::fail(__VA_ARGS__)

// A device as torch prints it (`cpu`, `cuda:0`, `meta`), never as an enum number.
inline std::string to_string(const Device& d) {
  const char* name = nullptr;
  switch (d.type()) {
    case DeviceType::CPU: name = "cpu"; break;
    case DeviceType::CUDA: name = "cuda"; break;
    case DeviceType::Meta: name = "meta"; break;
    case DeviceType::HIP: name = "hip"; break;
    case DeviceType::XPU: name = "xpu"; break;
    case DeviceType::MPS: name = "mps"; break;
    case DeviceType::XLA: name = "xla"; break;
    case DeviceType::HPU: name = "hpu"; break;
    case DeviceType::Lazy: name = "lazy"; break;
    case DeviceType::MTIA: name = "mtia"; break;
    case DeviceType::PrivateUse1: name = "privateuseone"; break;
    default: return "a device of type " + std::to_string(static_cast<int>(d.type())) + " (neither cpu nor cuda)";
  }
  return d.index() >= 0 && d.type() != DeviceType::CPU ? std::string(name) + ":" + std::to_string(d.index()) : std::string(name);
}

// A dtype as torch prints it (`torch.uint8`, `torch.bfloat16`).
inline std::string dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Byte: return "torch.uint8";
    case ScalarType::Char: return "torch.int8";
    case ScalarType::Short: return "torch.int16";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::Bool: return "torch.bool";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    case ScalarType::ComplexFloat: return "torch.complex64";
    case ScalarType::ComplexDouble: return "torch.complex128";
    default: return std::string("torch dtype ") + torch::headeronly::toString(t);
  }
}

inline std::string to_string(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}

inline std::string shape_of(const Tensor& t) {
  auto s = t.sizes();
  return to_string(std::vector<int64_t>(s.begin(), s.end()));
}

inline int32_t dtype_code(ScalarType t) {
  switch (t) {
    case ScalarType::BFloat16: return DEEP_EP_BF16;
    case ScalarType::Float: return DEEP_EP_F32;
    case ScalarType::Float8_e4m3fn: return DEEP_EP_FP8_E4M3;
    case ScalarType::Int: return DEEP_EP_I32;
    case ScalarType::Long: return DEEP_EP_I64;
    case ScalarType::Bool: return DEEP_EP_BOOL;
    case ScalarType::Byte: return DEEP_EP_U8;
    case ScalarType::Half: return DEEP_EP_F16;
    case ScalarType::Double: return DEEP_EP_F64;
    case ScalarType::Char: return DEEP_EP_I8;
    case ScalarType::Short: return DEEP_EP_I16;
    default: return DEEP_EP_OTHER;
  }
}

// Descriptor of a live tensor (the tensor must outlive the C call).
inline deep_ep_tensor_t raw(const Tensor& t) {
  deep_ep_tensor_t r{};
  r.data = t.data_ptr();
  r.dtype = dtype_code(t.scalar_type());
  r.device = t.is_cuda() ? t.get_device_index() : -1;
  r.ndim = static_cast<int32_t>(t.dim());
  auto sizes = t.sizes();
  auto strides = t.strides();
  for (int64_t d = 0; d < r.ndim && d < DEEP_EP_MAX_DIMS; ++d) {
    r.sizes[d] = sizes[d];
    r.strides[d] = strides[d];
  }
  return r;
}

inline deep_ep_tensor_t absent() {
  deep_ep_tensor_t r{};
  r.ndim = -1;
  return r;
}

inline deep_ep_tensor_t raw(const std::optional<Tensor>& t) { return t.has_value() ? raw(*t) : absent(); }

// Raises the library's message as a RuntimeError.
inline void check(int status) {
  if (status != 0) throw std::runtime_error(deep_ep_last_error());
}

// The CUDA half of the shim lives in libtorch_cuda.so, which a CPU-only torch does not ship.
// Linking it would make the library unloadable there, so the stable C function
// aoti_torch_get_current_cuda_stream is looked up in the already-loaded libtorch_cuda.so the
// first time a CUDA tensor reaches an op (it is loaded whenever CUDA tensors exist).
using CurrentCudaStreamFn = int32_t (*)(int32_t, void**);
inline CurrentCudaStreamFn current_cuda_stream_fn() {
  static CurrentCudaStreamFn fn = [] {
    void* lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    void* sym = lib ? dlsym(lib, "aoti_torch_get_current_cuda_stream") : dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    return reinterpret_cast<CurrentCudaStreamFn>(sym);
  }();
  return fn;
}

// The stream kernels on `device` launch on: torch's current stream (NULL on CPU).
inline void* stream_for(const Device& device) {
  if (device.type() != DeviceType::CUDA) return nullptr;
  auto fn = current_cuda_stream_fn();
  DEEP_EP_CHECK(fn != nullptr, "deep_ep: a CUDA tensor reached the library but torch's aoti_torch_get_current_cuda_stream "
                               "(libtorch_cuda.so) is not loaded in this process");
  void* stream = nullptr;
  DEEP_EP_CHECK(fn(device.index() < 0 ? 0 : device.index(), &stream) == 0, "deep_ep: torch could not report the current CUDA stream of ",
                to_string(device));
  return stream;
}

// Makes `device` current for the scope when it is a CUDA device (c10::OptionalDeviceGuard).
class __attribute__((visibility("hidden"))) DeviceScope {
 public:
  explicit DeviceScope(const Device& d) {
    if (d.type() == DeviceType::CUDA) guard_.emplace(d.index() < 0 ? 0 : d.index());
  }

 private:
  std::optional<torch::stable::accelerator::DeviceGuard> guard_;
};

// Buffer facts: rank, num_ranks, device, nvl bytes, rdma bytes, ll mode, backend.
struct BufferInfo {
  int64_t v[7];
  int64_t rank() const { return v[0]; }
  int64_t num_ranks() const { return v[1]; }
  int64_t num_rdma_bytes() const { return v[4]; }
  Device device() const { return v[2] >= 0 ? Device(DeviceType::CUDA, static_cast<int8_t>(v[2])) : Device(DeviceType::CPU); }
};

// The op this thread is in (set by buffer_info, which every buffer op calls first), so that
// errors raised below it, such as a failed output allocation, can name it.
inline const char*& current_op() {
  static thread_local const char* op = "deep_ep";
  return op;
}

// `op` ("deep_ep::dispatch") names the calling op in errors about the handle.
inline BufferInfo buffer_info(int64_t handle, const char* op) {
  current_op() = op;
  BufferInfo b{};
  check(deep_ep_buffer_info(handle, op, b.v));
  return b;
}

// config must be [num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv].
inline void fill_config(int64_t* dst, const IntList& config, const char* op) {
  DEEP_EP_CHECK(config.size() == 5, op, ": config must have 5 ints [num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv], got ",
                to_string(config));
  for (int i = 0; i < 5; ++i) dst[i] = config[i];
}

// Uninitialised / zeroed tensor on `like`'s device.
// An output allocation that failed (out of memory, a size torch refuses) becomes an error that
// names the op, the shape, the dtype, the device and the bytes, not torch's bare API failure.
template <typename F>
inline Tensor allocate(const IntList& shape, ScalarType dtype, const Device& device, F&& make) {
  try {
    return make();
  } catch (const std::exception& e) {
    double bytes = 1;
    for (int64_t s : shape) bytes *= static_cast<double>(s);
    std::ostringstream m;
    m << current_op() << ": cannot allocate an output of shape " << to_string(shape) << " (" << dtype_name(dtype) << ", "
      << bytes << " elements) on " << to_string(device) << ": " << e.what();
    throw std::runtime_error(m.str());
  }
}

// Uninitialised tensor of `shape` and `strides` on `device`, straight from the C shim's
// empty_strided (one allocator call: new_empty goes through the dispatcher twice, new_empty then
// empty, and a transposed view a third time; the host path of every op pays each hop).
inline Tensor empty_strided_on(const IntList& shape, const IntList& strides, ScalarType dtype, const Device& device) {
  return allocate(shape, dtype, device, [&] {
    const int32_t shim_dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
    const int32_t device_type = device.type() == DeviceType::CUDA ? aoti_torch_device_type_cuda() : aoti_torch_device_type_cpu();
    AtenTensorHandle h = nullptr;
    TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(shape.size()), shape.data(), strides.data(), shim_dtype,
                                                    device_type, device.type() == DeviceType::CUDA ? device.index() : 0, &h));
    return Tensor(h);
  });
}

// Row-major strides of `shape`.
inline IntList contiguous_strides(const IntList& shape) {
  IntList st(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) st[i - 1] = st[i] * (shape[i] > 1 ? shape[i] : 1);
  return st;
}

// Uninitialised tensor on `device` (CPU or CUDA: the shim's allocation, ~0.4 µs less per call than
// the dispatcher's aten::empty on the build machine; other devices: aten::empty).
inline Tensor empty_on(const IntList& shape, ScalarType dtype, const Device& device) {
  if (device.type() == DeviceType::CUDA || device.type() == DeviceType::CPU) {
    return empty_strided_on(shape, contiguous_strides(shape), dtype, device);
  }
  return allocate(shape, dtype, device, [&] { return torch::stable::empty(shape, dtype, std::nullopt, device); });
}

inline Tensor empty_like_dev(const Tensor& like, const IntList& shape, ScalarType dtype) {
  const Device d = like.device();
  // CPU and CUDA as empty_on; other devices through the tensor's own new_empty.
  if (d.type() == DeviceType::CUDA || d.type() == DeviceType::CPU) return empty_on(shape, dtype, d);
  return allocate(shape, dtype, d, [&] { return torch::stable::new_empty(like, shape, dtype); });
}
inline Tensor zeros_like_dev(const Tensor& like, const IntList& shape, ScalarType dtype) {
  return allocate(shape, dtype, like.device(), [&] { return torch::stable::new_zeros(like, shape, dtype); });
}
// Outputs allocated before the library has validated the arguments they are sized from (one
// validating call instead of two) stay below this size; larger ones wait for a validation-only
// call first, so that a wrong argument cannot ask for a huge allocation before its error.
constexpr double kAllocBeforeCheckBytes = 1 << 30;
inline bool small_output(int64_t rows, int64_t cols, int64_t elem) {
  return static_cast<double>(rows) * static_cast<double>(cols) * static_cast<double>(elem) <= kAllocBeforeCheckBytes;
}

// Empty tensor standing for an absent optional output. (Not a view of one cached empty tensor:
// two absent outputs of one call would then alias, which torch's schema check refuses.)
inline Tensor none_like(const Tensor& like, ScalarType dtype) { return empty_like_dev(like, {0}, dtype); }

// An optional output with one row per output row: [rows, t.size(1)] in t's dtype when its
// optional input t is given, else the empty placeholder of an absent output (`absent_dtype`).
inline Tensor rows_like(const std::optional<Tensor>& t, int64_t rows, const Tensor& x, ScalarType absent_dtype) {
  return t ? empty_like_dev(*t, {rows, t->size(1)}, t->scalar_type()) : none_like(x, absent_dtype);
}

// The raw view of such an output: absent when its input was not given.
inline deep_ep_tensor_t raw_if(const std::optional<Tensor>& given, const Tensor& out) { return given ? raw(out) : absent(); }

// The outputs of a row gather (cached dispatch, combine; intranode and internode): [rows, H] like x
// and, with `side` given ([*, K] scales or weights), its [rows, K] companion (else an empty f32
// one), with their raw views for the C API.
struct __attribute__((visibility("hidden"))) RowsOut {  // hidden, as its torch fields are (DeviceScope too)
  Tensor x, side;
  deep_ep_tensor_t raw_x, raw_side;
};
inline RowsOut rows_out(const Tensor& x, const std::optional<Tensor>& side, int64_t rows) {
  RowsOut o{empty_like_dev(x, {rows, x.size(1)}, x.scalar_type()), rows_like(side, rows, x, ScalarType::Float), {}, {}};
  o.raw_x = raw(o.x);
  o.raw_side = raw_if(side, o.side);
  return o;
}

inline bool present(const Tensor& t) { return t.defined() && t.dim() > 0 && !(t.dim() == 1 && t.size(0) == 0); }

}  // namespace deep_ep_ops
