// Helpers shared by the op implementations: tensor → deep_ep_tensor_t, status → RuntimeError,
// the stream to launch on. The only torch-aware code besides the Python package.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>
#include <optional>
#include "deep_ep_capi.h"
#ifdef USE_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace deep_ep_ops {

inline int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return DEEP_EP_BF16;
    case at::kFloat: return DEEP_EP_F32;
    case at::kFloat8_e4m3fn: return DEEP_EP_FP8_E4M3;
    case at::kInt: return DEEP_EP_I32;
    case at::kLong: return DEEP_EP_I64;
    case at::kBool: return DEEP_EP_BOOL;
    case at::kByte: return DEEP_EP_U8;
    case at::kHalf: return DEEP_EP_F16;
    case at::kDouble: return DEEP_EP_F64;
    case at::kChar: return DEEP_EP_I8;
    case at::kShort: return DEEP_EP_I16;
    default: return DEEP_EP_OTHER;
  }
}

// Descriptor of a live tensor (the tensor must outlive the C call).
inline deep_ep_tensor_t raw(const at::Tensor& t) {
  deep_ep_tensor_t r{};
  r.data = t.data_ptr();
  r.dtype = dtype_code(t.scalar_type());
  r.device = t.is_cuda() ? t.get_device() : -1;
  r.ndim = static_cast<int32_t>(t.dim());
  for (int64_t d = 0; d < t.dim() && d < DEEP_EP_MAX_DIMS; ++d) {
    r.sizes[d] = t.size(d);
    r.strides[d] = t.stride(d);
  }
  return r;
}

inline deep_ep_tensor_t absent() {
  deep_ep_tensor_t r{};
  r.ndim = -1;
  return r;
}

inline deep_ep_tensor_t raw(const std::optional<at::Tensor>& t) { return t.has_value() ? raw(*t) : absent(); }

// Raises the library's message as a RuntimeError.
inline void check(int status) { TORCH_CHECK(status == 0, deep_ep_last_error()); }

// The stream kernels on `device` launch on: torch's current stream (NULL on CPU).
inline void* stream_for(const at::Device& device) {
#ifdef USE_CUDA
  if (device.is_cuda()) return c10::cuda::getCurrentCUDAStream(device.index()).stream();
#endif
  return nullptr;
}

// Buffer facts: rank, num_ranks, device, nvl bytes, rdma bytes, ll mode, backend.
struct BufferInfo {
  int64_t v[7];
  int64_t rank() const { return v[0]; }
  int64_t num_ranks() const { return v[1]; }
};

// `op` ("deep_ep::dispatch") names the calling op in errors about the handle.
inline BufferInfo buffer_info(int64_t handle, const char* op) {
  BufferInfo b{};
  check(deep_ep_buffer_info(handle, op, b.v));
  return b;
}

// config must be [num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv].
inline void fill_config(int64_t* dst, at::IntArrayRef config, const char* op) {
  TORCH_CHECK(config.size() == 5, op, ": config must have 5 ints [num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv], got ", config);
  for (int i = 0; i < 5; ++i) dst[i] = config[i];
}

// Empty tensor standing for an absent optional output.
inline at::Tensor none_like(const at::TensorOptions& o) { return at::empty({0}, o); }

inline bool present(const at::Tensor& t) { return t.defined() && t.dim() > 0 && !(t.dim() == 1 && t.size(0) == 0); }

}  // namespace deep_ep_ops
