// layout.cu: DeepEP's get_dispatch_layout (token -> rank / node / expert counts and the
// is_token_in_rank mask). Must match `crate::layout::dispatch_layout` bit for bit.
//
// Design: topk_idx is read once by the whole GPU. For K <= 32 each warp takes 32 / K tokens at a
// time, one id per lane (coalesced), and __match_any_sync finds the first lane of each
// (token, rank) and (token, node) pair; for larger K one thread takes one token. Counts go to
// shared-memory counters with integer atomics (order-independent, hence deterministic) and are
// flushed once per block: a grid of one block stores them (one launch, no memset); a larger grid
// adds them with global atomics to outputs zeroed first. Counter arrays too large for shared
// memory (E + R + G > 12K) use global atomics directly.
#include <cstdint>

#include "common.cuh"

namespace deep_ep {
namespace layout {

// The kernels' arguments: a type of their signature, so it has external linkage as they do.
struct LayoutArgs {
  int num_tokens, num_topk, num_ranks, num_experts, num_nodes;
  int nvl_domain;  // ranks per node (DEEP_EP_NVL_DOMAIN_SIZE): node of rank r = r / nvl_domain
  int* num_tokens_per_rank;
  int* num_tokens_per_rdma_rank;
  int* num_tokens_per_expert;
  bool* is_token_in_rank;
};

namespace {

// Tuned on an H200 (N = 4096, K = 8, E = 256): 256 threads x 4 groups per warp beat 512 or 1024
// threads and 1 or 8 groups (fewer blocks flush fewer counters, more groups hide load latency).
constexpr int kLayoutThreads = 256;
// Warp path: groups of 32 / K tokens each warp loads at once before counting them.
constexpr int kLayoutWarpIters = 4;
constexpr int kLayoutMaxBlocks = 1024;
constexpr size_t kLayoutMaxSharedBytes = 48 * 1024;  // no opt-in attribute needed below this

// The expert id at `p`, or -1 when it is outside [0, num_experts) (compared in the index type,
// so an int64 id such as 2^32 + 3 is ignored, not truncated to 3).
template <typename IdxT>
__device__ __forceinline__ int expert_at(const IdxT* p, int num_experts) {
  const IdxT v = __ldg(p);
  return (v >= 0 && v < static_cast<IdxT>(num_experts)) ? static_cast<int>(v) : -1;
}

// Counter arrays the token loops add to: shared (flushed later) or the outputs themselves.
struct Counters {
  int* expert;
  int* rank;
  int* node;
};

// Warp-cooperative token loop (1 <= K <= 32): each warp takes kLayoutWarpIters groups of 32 / K
// consecutive tokens, loads all their ids first (one per lane and group, coalesced, in flight
// together), then lets the first lane of each (token, rank) and (token, node) pair, found with
// __match_any_sync, count it.
template <typename IdxT>
__device__ __forceinline__ void layout_tokens_warp(const IdxT* __restrict__ topk_idx, const LayoutArgs& a,
                                                   Counters c) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int per_group = 32 / a.num_topk;  // tokens per group
  const int per_chunk = per_group * kLayoutWarpIters;
  const int j = lane / a.num_topk, k = lane - j * a.num_topk;
  const int experts_per_rank = a.num_experts / a.num_ranks;  // > 0 whenever an id is valid
  // Loop bounds depend on the warp only, so every lane reaches the *_sync calls.
  for (int64_t base = warp * per_chunk; base < a.num_tokens; base += num_warps * per_chunk) {
    int e[kLayoutWarpIters];
#pragma unroll
    for (int it = 0; it < kLayoutWarpIters; ++it) {
      const int64_t t = base + it * per_group + j;
      e[it] = (j < per_group && t < a.num_tokens) ? expert_at(topk_idx + t * a.num_topk + k, a.num_experts) : -1;
    }
    const int64_t rows = min(static_cast<int64_t>(per_chunk), a.num_tokens - base);
    bool* in_rank = a.is_token_in_rank + base * a.num_ranks;
    for (int64_t i = lane; i < rows * a.num_ranks; i += 32) in_rank[i] = false;
    __syncwarp();  // the zeros land before the ones below
#pragma unroll
    for (int it = 0; it < kLayoutWarpIters; ++it) {
      const int ei = e[it];
      const int r = ei >= 0 ? ei / experts_per_rank : 0;
      const int g = r / a.nvl_domain;
      const int row = it * per_group + j;  // token index inside the chunk
      // Lanes without a valid id get keys no other lane has (valid keys stay below 2^31).
      const unsigned none = 0x80000000u | static_cast<unsigned>(lane);
      const unsigned rank_key = ei >= 0 ? static_cast<unsigned>(j * a.num_ranks + r) : none;
      const unsigned node_key = ei >= 0 ? static_cast<unsigned>(j * (a.num_ranks / a.nvl_domain + 1) + g) : none;
      const bool first_rank = __ffs(__match_any_sync(0xffffffffu, rank_key)) - 1 == lane;
      const bool first_node = __ffs(__match_any_sync(0xffffffffu, node_key)) - 1 == lane;
      if (ei < 0) continue;
      atomicAdd(&c.expert[ei], 1);
      if (first_rank) {
        in_rank[static_cast<int64_t>(row) * a.num_ranks + r] = true;
        atomicAdd(&c.rank[r], 1);
      }
      if (first_node && g < a.num_nodes) atomicAdd(&c.node[g], 1);
    }
  }
}

// One thread per token, for any K: dedup against the token's earlier selections.
template <typename IdxT>
__device__ __forceinline__ void layout_tokens_thread(const IdxT* __restrict__ topk_idx, const LayoutArgs& a,
                                                     Counters c) {
  const int experts_per_rank = a.num_experts / a.num_ranks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < a.num_tokens; t += stride) {
    const IdxT* row = topk_idx + t * a.num_topk;
    bool* in_rank = a.is_token_in_rank + t * a.num_ranks;
    for (int r = 0; r < a.num_ranks; ++r) in_rank[r] = false;
    for (int k = 0; k < a.num_topk; ++k) {
      const int e = expert_at(row + k, a.num_experts);
      if (e < 0) continue;
      atomicAdd(&c.expert[e], 1);
      const int r = e / experts_per_rank;
      const int g = r / a.nvl_domain;
      bool first_rank = true, first_node = true;
      for (int i = 0; i < k; ++i) {
        const int ei = expert_at(row + i, a.num_experts);
        if (ei < 0) continue;
        first_rank &= (ei / experts_per_rank != r);
        first_node &= (ei / experts_per_rank / a.nvl_domain != g);
      }
      if (first_rank) {
        in_rank[r] = true;
        atomicAdd(&c.rank[r], 1);
      }
      if (first_node && g < a.num_nodes) atomicAdd(&c.node[g], 1);
    }
  }
}

}  // namespace

// kSmem: counters in shared memory, flushed once per block (stored directly when the grid is
// one block, else added with global atomics to zeroed outputs). Otherwise global atomics only.
// Both are template parameters so every atomic has a statically known address space.
template <typename IdxT, bool kSmem, bool kWarp>
__global__ void __launch_bounds__(kLayoutThreads)
dispatch_layout(const IdxT* __restrict__ topk_idx, LayoutArgs a) {
  extern __shared__ int smem_counters[];
  const int num_counters = a.num_experts + a.num_ranks + a.num_nodes;
  Counters c{a.num_tokens_per_expert, a.num_tokens_per_rank, a.num_tokens_per_rdma_rank};
  if constexpr (kSmem) {
    c = Counters{smem_counters, smem_counters + a.num_experts, smem_counters + a.num_experts + a.num_ranks};
    for (int i = threadIdx.x; i < num_counters; i += blockDim.x) smem_counters[i] = 0;
    __syncthreads();
  }
  if constexpr (kWarp) {
    layout_tokens_warp(topk_idx, a, c);
  } else {
    layout_tokens_thread(topk_idx, a, c);
  }
  if constexpr (kSmem) {
    __syncthreads();
    const bool direct_store = gridDim.x == 1;
    for (int i = threadIdx.x; i < num_counters; i += blockDim.x) {
      const int v = smem_counters[i];
      int* dst = i < a.num_experts                 ? a.num_tokens_per_expert + i
                 : i < a.num_experts + a.num_ranks ? a.num_tokens_per_rank + (i - a.num_experts)
                                                   : a.num_tokens_per_rdma_rank + (i - a.num_experts - a.num_ranks);
      if (direct_store) {
        *dst = v;
      } else if (v != 0) {
        atomicAdd(dst, v);
      }
    }
  }
}

// Zeroes the count outputs before a multi-block launch adds into them (one launch instead of
// three memsets).
__global__ void zero_counts(LayoutArgs a) {
  for (int i = threadIdx.x; i < a.num_ranks; i += blockDim.x) a.num_tokens_per_rank[i] = 0;
  for (int i = threadIdx.x; i < a.num_nodes; i += blockDim.x) a.num_tokens_per_rdma_rank[i] = 0;
  for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x) a.num_tokens_per_expert[i] = 0;
}

namespace {

template <typename IdxT>
cudaError_t launch_layout(const void* topk_idx, const LayoutArgs& a, bool smem, bool warp, dim3 grid,
                          size_t shared, cudaStream_t s) {
  const IdxT* idx = static_cast<const IdxT*>(topk_idx);
  const dim3 block(kLayoutThreads);
  if (smem && warp) dispatch_layout<IdxT, true, true><<<grid, block, shared, s>>>(idx, a);
  if (smem && !warp) dispatch_layout<IdxT, true, false><<<grid, block, shared, s>>>(idx, a);
  if (!smem && warp) dispatch_layout<IdxT, false, true><<<grid, block, 0, s>>>(idx, a);
  if (!smem && !warp) dispatch_layout<IdxT, false, false><<<grid, block, 0, s>>>(idx, a);
  return cudaGetLastError();
}

}  // namespace
}  // namespace layout
}  // namespace deep_ep

extern "C" int dek_dispatch_layout(const void* topk_idx, int topk_idx_is_int64,
                                              int num_tokens, int num_topk, int num_ranks,
                                              int num_experts, int* num_tokens_per_rank,
                                              int* num_tokens_per_rdma_rank,
                                              int* num_tokens_per_expert,
                                              bool* is_token_in_rank, int nvl_domain, void* stream) {
  using namespace deep_ep;
  using namespace deep_ep::layout;
  if (num_tokens < 0 || num_topk < 0 || num_ranks <= 0 || num_experts < 0 || nvl_domain < 1 ||
      num_experts % num_ranks != 0 || (num_ranks > nvl_domain && num_ranks % nvl_domain != 0))
    return cudaErrorInvalidValue;
  const int num_nodes = num_ranks > nvl_domain ? num_ranks / nvl_domain : 0;
  if (num_tokens_per_rank == nullptr || (num_nodes > 0 && num_tokens_per_rdma_rank == nullptr) ||
      (num_experts > 0 && num_tokens_per_expert == nullptr) ||
      (num_tokens > 0 && (is_token_in_rank == nullptr || (num_topk > 0 && topk_idx == nullptr))))
    return cudaErrorInvalidValue;

  const cudaStream_t s = as_stream(stream);
  const size_t smem_bytes = (static_cast<size_t>(num_experts) + num_ranks + num_nodes) * sizeof(int);
  const bool in_smem = smem_bytes <= kLayoutMaxSharedBytes;
  const bool warp = num_topk >= 1 && num_topk <= 32;
  const int64_t per_block = warp ? static_cast<int64_t>(32 / num_topk) * (kLayoutThreads / 32) * kLayoutWarpIters
                                 : kLayoutThreads;
  int64_t blocks = (static_cast<int64_t>(num_tokens) + per_block - 1) / per_block;
  blocks = blocks < 1 ? 1 : (blocks > kLayoutMaxBlocks ? kLayoutMaxBlocks : blocks);

  const LayoutArgs a{num_tokens, num_topk, num_ranks, num_experts, num_nodes, nvl_domain, num_tokens_per_rank,
                     num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank};
  if (!(in_smem && blocks == 1)) {  // only a one-block launch with shared counters stores directly
    zero_counts<<<1, 1024, 0, s>>>(a);
    DEEP_EP_TRY(cudaGetLastError());
    if (num_tokens == 0) return cudaSuccess;  // nothing else to write
  }
  const dim3 grid(static_cast<unsigned>(blocks));
  const size_t shared = in_smem ? smem_bytes : 0;
  const cudaError_t st = topk_idx_is_int64 ? launch_layout<int64_t>(topk_idx, a, in_smem, warp, grid, shared, s)
                                           : launch_layout<int32_t>(topk_idx, a, in_smem, warp, grid, shared, s);
  return static_cast<int>(st);
}
