// common.cuh: helpers shared by kernels/*.cu (host side of the launch API).
#pragma once

#include <cuda_runtime.h>

#include "deep_ep_kernels.h"

// Returns the cudaError_t of `expr` as int from the enclosing launch function when it failed.
#define DEEP_EP_TRY(expr)                                 \
  do {                                                    \
    const cudaError_t deep_ep_status_ = (expr);           \
    if (deep_ep_status_ != cudaSuccess) {                 \
      return static_cast<int>(deep_ep_status_);           \
    }                                                     \
  } while (0)

namespace deep_ep {

// Ranks per NVLink domain (node); `crate::config::MAX_NVL_PEERS` on the Rust side.
constexpr int kMaxNvlPeers = 8;

// The C API passes streams as void* so its header needs no CUDA include.
inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace deep_ep
