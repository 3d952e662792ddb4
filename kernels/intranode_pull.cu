// intranode_pull.cu: the pull kernel of the intranode normal-mode (cached) dispatch (K3 of the
// pull model). It runs after the data barrier, so every peer's staged sections are complete and
// stay unchanged until this rank's next op starts (the next op begins with a barrier). Peer memory
// is read with L2-only loads (__ldcg); nothing here waits on anything. (The combine kernels are in
// intranode_combine.cu.)
//
// pull_dispatch (dispatch, cached dispatch): one warp per task of kTaskTokens consecutive tokens of
// one source; lanes read the tokens' send_head entries for this rank, compute their destination
// rows, and the warp copies the selected rows one after the other (16-byte loads, kPullUnroll = 16
// in flight per lane by default, the row's scales / top-k words loaded before its data).
#include <cstdint>

#include "intranode.cuh"

namespace deep_ep {
namespace ic {
namespace {

// Copies the gathered layouts (scratch) into shared memory.
__device__ __forceinline__ void load_layouts(const Ctx& c, Layout* s_layout) {
  const int words = sizeof(Layout) / 8;
  for (int i = threadIdx.x; i < c.num_ranks * words; i += blockDim.x) {
    const int p = i / words, w = i % words;
    reinterpret_cast<uint64_t*>(&s_layout[p])[w] = reinterpret_cast<const uint64_t*>(&scratch_layout(c, p))[w];
  }
  __syncthreads();
}

// Tokens per pull task: small tasks balance the warps' work (a 7168-wide BF16 row is ~5 us of
// one warp's NVLink loads; the task's send_head reads cost one round trip).
constexpr int kTaskTokens = 8;
// 16-byte loads in flight per lane in the row copy (the default; DEEP_EP_INTRANODE_PULL_UNROLL):
// 8 KiB per warp, so a 7168-wide BF16 row takes two round trips and an FP8 row one (at 20 SMs the
// pull is bound by bytes in flight, not by the link: bench/NOTES.md, session 4).
constexpr int kPullUnroll = 16;

}  // namespace

// kU: 16-byte loads in flight per lane of a row copy (kPullUnroll = 16, or 8; 8 or 4 with 1024
// threads, where 16 spills; DEEP_EP_INTRANODE_PULL_UNROLL). kT: threads per
// block, kThreads or 1024 (DEEP_EP_INTRANODE_PULL_THREADS: twice the warps per SM at a
// 64-register cap; measured so far: the NVLink rate follows the number of warps with copies in
// flight rather than their depth, bench/NOTES.md).
template <int kU, int kT>
__global__ void __launch_bounds__(kT) pull_dispatch(const __grid_constant__ Ctx c, const __grid_constant__ dek_ic_pull_args_t a) {
  __shared__ Layout s_layout[kMaxRanks];
  __shared__ int64_t s_task_start[kMaxRanks + 1];
  if (op_cancelled(c)) return;
  load_layouts(c, s_layout);
  const int R = c.num_ranks, rank = c.rank, tid = threadIdx.x, lane = tid & 31;
  // Tasks of kTaskTokens tokens, sources in the order rank, rank + 1, ... (mod R): at any time
  // the ranks mostly read from different sources, so no source's NVLink egress is shared by all.
  if (tid == 0) {
    int64_t acc = 0;
    for (int v = 0; v < R; ++v) {
      s_task_start[v] = acc;
      acc += (s_layout[(rank + v) % R].num_tokens + kTaskTokens - 1) / kTaskTokens;
    }
    s_task_start[R] = acc;
  }
  __syncthreads();

  const Layout& me = s_layout[rank];
  const int* rpm = a.rpm_in != nullptr ? a.rpm_in : at<const int>(peer_local(c), kScrRpm);
  const int* rcpm = a.rcpm_in != nullptr ? a.rcpm_in : at<const int>(peer_local(c), kScrRcpm);
  const int C = static_cast<int>(me.num_channels);
  const int64_t rb = me.row_bytes, S = me.num_scales, K = me.num_topk, el = a.num_local_experts;
  const int64_t received = max(rpm[(R - 1) * R + rank], 0);
  const int64_t real_rows = min(received, a.num_rows);
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gwarp = gtid >> 5, warps = threads >> 5;

  write_handle_outputs(c, a, me, rpm, rcpm, gtid, threads);

  char* recv_x = static_cast<char*>(a.recv_x);
  uint32_t* recv_scales = static_cast<uint32_t*>(a.recv_scales);
  pad_rows(a, me, real_rows, gwarp, warps, lane);  // the worst-case padding rows

  // Received rows.
  const int64_t total = s_task_start[R];
  for (int64_t task = gwarp; task < total; task += warps) {
    int v = 0;
    while (v + 1 < R && s_task_start[v + 1] <= task) ++v;
    const int s = (rank + v) % R;
    const Layout& L = s_layout[s];
    const int64_t first = (task - s_task_start[v]) * kTaskTokens;
    const int64_t per = tokens_per_channel(L.num_tokens, C);
    const char* src = peer_window(c, s);
    const int64_t t = first + lane;
    int64_t row = -1;
    if (lane < kTaskTokens && t < L.num_tokens) {
      const int sh = __ldcg(at<const int>(const_cast<char*>(src), L.off[DEK_IC_SEC_SEND_HEAD]) + t * R + rank);
      if (sh >= 0) {
        const int64_t ch = t / per;
        row = (s > 0 ? rpm[(s - 1) * R + rank] : 0) + rcpm[s * C + ch] + sh;
        if (row >= a.num_rows) row = -1;  // worst-case overflow (notify reported it)
      }
    }
    unsigned mask = __ballot_sync(0xffffffffu, row >= 0);
    while (mask != 0) {
      const int b = __ffs(mask) - 1;
      mask &= mask - 1;
      const int64_t r = __shfl_sync(0xffffffffu, row, b);
      const int64_t tok = first + b;
      // The row's small arrays first: their remote loads are then in flight together with the
      // row's instead of costing two or three more round trips after it.
      const uint32_t* sc = recv_scales != nullptr ? reinterpret_cast<const uint32_t*>(src + L.off[DEK_IC_SEC_SCALES]) + tok * S : nullptr;
      const long long* ids = reinterpret_cast<const long long*>(src + L.off[DEK_IC_SEC_TOPK]) + tok * K;
      const float* w = reinterpret_cast<const float*>(src + L.off[DEK_IC_SEC_WEIGHTS]) + tok * K;
      uint32_t sc_pre[2] = {0, 0};
      if (sc != nullptr) {
        if (lane < S) sc_pre[0] = __ldcg(sc + lane);
        if (lane + 32 < S) sc_pre[1] = __ldcg(sc + lane + 32);
      }
      long long id_pre = -1;
      float w_pre = 0.0f;
      if (a.recv_topk_idx != nullptr && lane < K) {
        id_pre = __ldcg(ids + lane);
        if (a.recv_topk_weights != nullptr) w_pre = __ldcg(w + lane);
      }
      warp_copy<kU>(recv_x + r * rb, src + L.off[DEK_IC_SEC_X] + tok * rb, rb, lane);
      if (sc != nullptr) {
        if (lane < S) recv_scales[r * S + lane] = sc_pre[0];
        if (lane + 32 < S) recv_scales[r * S + lane + 32] = sc_pre[1];
        for (int64_t j = lane + 64; j < S; j += 32) recv_scales[r * S + j] = __ldcg(sc + j);
      }
      if (a.recv_topk_idx != nullptr) {
        for (int64_t j = lane; j < K; j += 32) {
          const int64_t id = j == lane ? id_pre : __ldcg(ids + j);
          const int64_t lo = rank * el;
          const int64_t local_id = (id >= lo && id < lo + el) ? id - lo : -1;
          if (a.topk_is_int64) static_cast<int64_t*>(a.recv_topk_idx)[r * K + j] = local_id;
          else static_cast<int32_t*>(a.recv_topk_idx)[r * K + j] = static_cast<int32_t>(local_id);
          if (a.recv_topk_weights != nullptr) a.recv_topk_weights[r * K + j] = local_id >= 0 ? (j == lane ? w_pre : __ldcg(w + j)) : 0.0f;
        }
      }
      if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[r] = static_cast<int32_t>(tok);
    }
  }
}
}  // namespace ic
}  // namespace deep_ep

using namespace deep_ep;
using namespace deep_ep::ic;

extern "C" int dek_ic_pull(const dek_ic_ctx_t* ctx, const dek_ic_pull_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_blocks < 1 || args->num_rows < 0 ||
      (args->num_rows > 0 && args->recv_x == nullptr) || args->num_local_experts < 0)
    return cudaErrorInvalidValue;
  const cudaStream_t s = as_stream(stream);
  if (args->threads >= 1024) {
    // No unroll 16 here: at 64 registers it spills ~750 bytes (unroll 0 or 16 -> 8).
    if (args->unroll > 0 && args->unroll <= 4) pull_dispatch<4, 1024><<<args->num_blocks, 1024, 0, s>>>(*ctx, *args);
    else pull_dispatch<8, 1024><<<args->num_blocks, 1024, 0, s>>>(*ctx, *args);
  } else {
    // 0 = the default, kPullUnroll; 4 is only offered with 1024 threads (-> 8 here).
    if (args->unroll == 0 || args->unroll >= 16) pull_dispatch<kPullUnroll, kThreads><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
    else pull_dispatch<8, kThreads><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  }
  return cudaGetLastError();
}
