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
__host__ __device__ constexpr int rank_workers(int n) { return DEEP_EP_TEST_RANK_STRIDE ? 1 : n; }

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
// Relaxed (strong, not ordering) system-scope store: after a `fence.acq_rel.sys` of the same
// thread it is a release pattern, so a run of flags costs one fence instead of one per store.
__device__ __forceinline__ void st_relaxed_sys_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
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

// Release/acquire fence at system scope (`fence.acq_rel.sys`): what a flag protocol needs (stores
// before it are seen before stores after it, by peers that acquire). `__threadfence_system()` is
// `fence.sc.sys`, a sequentially consistent fence that also orders stores before later loads,
// which no signal here relies on, and is the costliest instruction of the LL send kernels
// (bench/LL_PROFILE.md, sections 2 and 4).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Sum of v over the 32 lanes of a warp (every lane gets it; the whole warp must call it). Wrapping
// sums give the same value in any order; a 64-bit shared-memory atomicAdd is a compare-and-swap
// loop that serialises a block adding to one word (bench/LL_PROFILE.md, section 6).
__device__ __forceinline__ uint64_t warp_sum_u64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block sums of two u64 values, in two halves around the caller's __syncthreads(): the whole warp
// calls warp_shares_u64 (its lane 0 stores the warp's sums at [warp] of `s0` and `s1`, shared
// memory of a slot per warp), then one thread adds the `warps` shares with shares_sum_u64.
__device__ __forceinline__ void warp_shares_u64(uint64_t v0, uint64_t v1, unsigned long long* s0, unsigned long long* s1) {
  v0 = warp_sum_u64(v0);
  v1 = warp_sum_u64(v1);
  if (threadIdx.x % 32 == 0) {
    s0[threadIdx.x / 32] = v0;
    s1[threadIdx.x / 32] = v1;
  }
}
__device__ __forceinline__ uint64_t shares_sum_u64(const unsigned long long* s, int warps) {
  uint64_t v = 0;
  for (int w = 0; w < warps; ++w) v += s[w];
  return v;
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
