// common.cuh: helpers shared by kernels/*.cu: the host side of the launch API, and the device
// primitives every protocol uses (global timer, acquire/release words, 16-byte warp copies).
#pragma once

#include <cstdint>

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

// Workers (warps or threads) of a block that share a loop over ranks or nodes: all `n` of them,
// or one in the rank-stride test build (cargo feature `rank-stride-test`, docs/RANKS.md), so that
// runs of a few ranks go through the iterations that only large buffers take otherwise. A loop
// `for (i = w; i < count && w < rank_workers(n); i += rank_workers(n))` over worker w.
#ifndef DEEP_EP_TEST_RANK_STRIDE
#define DEEP_EP_TEST_RANK_STRIDE 0
#endif
constexpr int rank_workers(int n) { return DEEP_EP_TEST_RANK_STRIDE ? 1 : n; }

// The C API passes streams as void* so its header needs no CUDA include.
inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Device primitives. Internal linkage: the .cu files are compiled with -rdc and each gets its own.
namespace {

// Nanoseconds of the GPU's global timer (deadlines of every wait).
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// System-scope release store / acquire load of a 64-bit flag (peers' GPUs read and write it).
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// The same for a 32-bit word (low-latency signal words).
__device__ __forceinline__ void st_release_sys_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }
__device__ __forceinline__ uint64_t ld_volatile(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

// One warp copies `n16` 16-byte words from `src` to `dst` (both 16-aligned): L2-only loads (peer
// memory changes between ops, so no non-coherent cache path), kUnroll loads in flight per lane.
template <int kUnroll>
__device__ __forceinline__ void warp_copy16(int4* dst, const int4* src, int64_t n16, int lane) {
  for (int64_t base = 0; base < n16; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) v[u] = __ldcg(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) dst[i] = v[u];
    }
  }
}

}  // namespace

}  // namespace deep_ep
