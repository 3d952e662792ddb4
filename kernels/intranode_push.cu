// intranode_push.cu: push model of the intranode normal-mode dispatch (deep_ep_kernels.h).
//
// dispatch_push_kernel (K3, after the notify / data barrier): one warp per token of this rank.
// Lane d < R finds the token's output row on rank d (index words loaded one token ahead), then
// the warp reads the row of x once from local memory (8 16-byte loads per lane in flight) and
// stores each piece to every destination: remote ranks first, in the order rank + 1, rank + 2, ...
// (at any time the ranks mostly write to different peers), this rank's own outputs last. Row
// numbering and every side output are those of the pull model (intranode_pull.cu), so results are
// bit-identical; only who moves the bytes changes (NVLink stores, which measured faster than
// NVLink loads, and no staging copy of x).
// copy_out_kernel (K5, after the barrier that follows the push): local copies from this rank's
// receive area into its outputs. The area is in output-row order, so rows are two contiguous
// ranges (before and after the block this rank sent itself): flat 16-byte copies, no per-row work.
#include <cstdint>

#include "intranode.cuh"

namespace deep_ep {
namespace ic {
namespace {

constexpr int kPushUnroll = 8;  // 16-byte loads in flight per lane (one row piece = 4 KiB)

__device__ __forceinline__ int4 ld_nc(const int4* p) { return __ldg(p); }

// One destination's copy of token t's side outputs (and its row when not 16-byte aligned): into
// this rank's outputs (own) or into rank d's receive area A, at row r. One warp.
__device__ __noinline__ void push_side(const deep_ep_ic_dispatch_push_args_t& a, const RecvArea& A, int d, bool own, int64_t r,
                                       int64_t t, int64_t rb, int64_t S, int64_t K, bool vec, int lane) {
  if (!vec) warp_copy((own ? static_cast<char*>(a.recv_x) : A.x) + r * rb, static_cast<const char*>(a.x) + t * rb, rb, lane);
  const uint32_t* scales = static_cast<const uint32_t*>(a.scales);
  uint32_t* sc = own ? static_cast<uint32_t*>(a.recv_scales) : A.scales;
  if (scales != nullptr && sc != nullptr) {
    for (int64_t k = lane; k < S; k += 32) sc[r * S + k] = scales[t * a.scale_stride0 + k * a.scale_stride1];
  }
  if (a.topk_idx != nullptr) {
    // Own outputs in the input's dtype; receive areas hold int64.
    int64_t* ids64 = own ? (a.topk_is_int64 ? static_cast<int64_t*>(a.recv_topk_idx) : nullptr) : A.ids;
    int32_t* ids32 = own && !a.topk_is_int64 ? static_cast<int32_t*>(a.recv_topk_idx) : nullptr;
    float* w = own ? a.recv_topk_weights : A.weights;
    const int64_t el = a.num_local_experts, lo = d * el;
    for (int64_t k = lane; k < K; k += 32) {
      const int64_t id = a.topk_is_int64 ? static_cast<const int64_t*>(a.topk_idx)[t * K + k] : static_cast<const int32_t*>(a.topk_idx)[t * K + k];
      const int64_t local_id = (id >= lo && id < lo + el) ? id - lo : -1;
      if (ids64 != nullptr) ids64[r * K + k] = local_id;
      if (ids32 != nullptr) ids32[r * K + k] = static_cast<int32_t>(local_id);
      if (w != nullptr) w[r * K + k] = local_id >= 0 && a.topk_weights != nullptr ? a.topk_weights[t * K + k] : 0.0f;
    }
  }
  int32_t* src = own ? a.recv_src_idx : A.src;
  if (src != nullptr && lane == 0) src[r] = static_cast<int32_t>(t);
}

template <int kR>
__global__ void __launch_bounds__(kThreads)
    dispatch_push_kernel(const __grid_constant__ Ctx c, const __grid_constant__ deep_ep_ic_dispatch_push_args_t a) {
  __shared__ RecvArea s_area[kMaxRanks];
  __shared__ int64_t s_base[kMaxRanks];   // s_base[d]: first row of this rank's block on d
  __shared__ int64_t s_limit[kMaxRanks];  // rows d keeps
  __shared__ int s_fail;
  if (op_cancelled(c)) return;
  const int R = c.num_ranks, me = c.rank, tid = threadIdx.x, lane = tid & 31;
  const int* rpm = a.rpm_in != nullptr ? a.rpm_in : at<const int>(local(c), kScrRpm);
  if (tid == 0) {
    s_fail = 0;
    for (int d = 0; d < R; ++d) {
      const Layout& L = scratch_layout(c, d);
      uint64_t need_kib = 0;
      if (L.recv_off == 0 || !recv_fits(L, pushed_rows(L, rpm[(R - 1) * R + d]), &need_kib)) {
        s_fail = 1;
        if (blockIdx.x == 0) {  // every rank finds the same: all skip this op
          report(c, DEEP_EP_IC_ERR_CAPACITY, d, DEEP_EP_IC_SITE_DISPATCH_PUSH, static_cast<int>(min(need_kib, uint64_t{INT32_MAX})),
                 static_cast<int>(min(c.window_bytes >> 10, uint64_t{INT32_MAX})));
          *at<volatile int>(local(c), kScrOpBad) = 1;
        }
        break;
      }
      s_area[d] = recv_area(window(c, d), L);
      s_base[d] = me > 0 ? rpm[(me - 1) * R + d] : 0;
      // Also never past the area (only an inconsistent cached handle could get there).
      s_limit[d] = min(L.recv_limit >= 0 ? L.recv_limit : INT64_MAX, L.recv_cap);
    }
    s_limit[me] = min(s_limit[me], a.num_rows);  // own outputs: never past their rows
  }
  __syncthreads();
  if (s_fail) return;

  const Layout& mine = scratch_layout(c, me);
  const int C = static_cast<int>(mine.num_channels);
  const int64_t N = a.num_tokens, rb = mine.row_bytes, S = mine.num_scales, K = mine.num_topk;
  const int64_t per = tokens_per_channel(N, C);
  const int* sh = a.send_head != nullptr ? a.send_head : at<const int>(local(c), mine.off[DEEP_EP_IC_SEC_SEND_HEAD]);
  const int* cpm = a.channel_prefix_matrix != nullptr ? a.channel_prefix_matrix : at<const int>(local(c), mine.off[DEEP_EP_IC_SEC_CPM]);
  const char* x = static_cast<const char*>(a.x);
  char* recv_x = static_cast<char*>(a.recv_x);
  // Window receive areas are 128-aligned and rows follow at multiples of rb.
  const bool vec = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(recv_x) | static_cast<uintptr_t>(rb)) & 15) == 0;
  const int n16 = static_cast<int>(rb / 16);
  const int64_t gwarp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + tid) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;

  // Lane d < R: send_head[t][d] and this rank's channel start on d.
  auto load_idx = [&](int64_t t, int& s, int& cp) {
    s = -1;
    cp = 0;
    if (lane < R && t < N) {
      s = sh[t * R + lane];
      const int64_t ch = t / per;
      if (ch > 0) cp = cpm[lane * C + ch - 1];
    }
  };
  int nx_s, nx_cp;
  load_idx(gwarp, nx_s, nx_cp);
  for (int64_t t = gwarp; t < N; t += warps) {
    const int cur_s = nx_s, cur_cp = nx_cp;
    load_idx(t + warps, nx_s, nx_cp);
    int64_t row = -1;
    if (lane < R && cur_s >= 0) {
      row = s_base[lane] + cur_cp + cur_s;
      if (row >= s_limit[lane]) row = -1;  // worst-case overflow (notify reported it)
    }
    // Destination j is rank (me + 1 + j) % R: peers first, this rank last.
    int64_t rows[kR];
    char* dst[kR];
#pragma unroll
    for (int j = 0; j < kR; ++j) {
      int d = me + 1 + j;
      d = d >= R ? d - R : d;
      d = d >= R ? d - R : d;  // j >= R: any lane, discarded below
      rows[j] = __shfl_sync(0xffffffffu, row, d);
      dst[j] = nullptr;
      if (j < R && rows[j] >= 0) dst[j] = (d == me ? recv_x : s_area[d].x) + rows[j] * rb;
    }
    const char* src = x + t * rb;
    if (vec) {
      // Pointers advance with `base`; the pieces are at constant offsets (immediate operands,
      // not one 64-bit address per piece and destination in registers).
      for (int base = lane; base < n16; base += 32 * kPushUnroll) {
        const int4* sp = reinterpret_cast<const int4*>(src) + base;
        const int rem = n16 - base;
        int4 v[kPushUnroll];
#pragma unroll
        for (int u = 0; u < kPushUnroll; ++u) {
          if (32 * u < rem) v[u] = ld_nc(sp + 32 * u);
        }
#pragma unroll
        for (int j = 0; j < kR; ++j) {
          if (dst[j] == nullptr) continue;
          int4* dp = reinterpret_cast<int4*>(dst[j]) + base;
#pragma unroll
          for (int u = 0; u < kPushUnroll; ++u) {
            if (32 * u < rem) dp[32 * u] = v[u];
          }
        }
      }
    }
    // Rows that are not 16-byte aligned, and the side outputs (a few words per row): a rolled
    // loop over destinations, out of line (registers of the copy loop above).
#pragma unroll 1
    for (int d = 0; d < R; ++d) {
      const int64_t r = __shfl_sync(0xffffffffu, row, d);
      if (r >= 0) push_side(a, s_area[d], d, d == me, r, t, rb, S, K, vec, lane);
    }
  }
  __threadfence_system();  // the remote writes are performed before the next barrier signals
}

// Maps a flat index over [0, lo) ++ [hi, end) (lo <= hi) to its position.
__device__ __forceinline__ int64_t skip_gap(int64_t i, int64_t lo, int64_t gap) { return i < lo ? i : i + gap; }

__global__ void __launch_bounds__(kThreads) copy_out_kernel(const __grid_constant__ Ctx c, const __grid_constant__ deep_ep_ic_pull_args_t a) {
  if (op_cancelled(c)) return;
  const int R = c.num_ranks, rank = c.rank, tid = threadIdx.x, lane = tid & 31;
  const Layout& me = scratch_layout(c, rank);
  const int* rpm = a.rpm_in != nullptr ? a.rpm_in : at<const int>(local(c), kScrRpm);
  const int* rcpm = a.rcpm_in != nullptr ? a.rcpm_in : at<const int>(local(c), kScrRcpm);
  const int C = static_cast<int>(me.num_channels);
  const int64_t rb = me.row_bytes, S = me.num_scales, K = me.num_topk;
  const int64_t received = max(rpm[(R - 1) * R + rank], 0);
  const int64_t real_rows = min(received, a.num_rows);
  // The block this rank sent itself (already in the outputs).
  const int64_t lo = min(max(rank > 0 ? static_cast<int64_t>(rpm[(rank - 1) * R + rank]) : 0, int64_t{0}), real_rows);
  const int64_t hi = min(max(static_cast<int64_t>(rpm[rank * R + rank]), lo), real_rows);
  const int64_t gap = hi - lo, moved = real_rows - gap;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gwarp = gtid >> 5, warps = threads >> 5;
  const RecvArea A = recv_area(local(c), me);

  // Handle outputs (dispatch), as pull_kernel.
  if (a.rank_prefix_matrix != nullptr) {
    for (int64_t i = gtid; i < R * R; i += threads) a.rank_prefix_matrix[i] = rpm[i];
  }
  if (a.recv_channel_prefix_matrix != nullptr) {
    for (int64_t i = gtid; i < R * C; i += threads) a.recv_channel_prefix_matrix[i] = rcpm[i];
  }
  if (a.channel_prefix_matrix != nullptr) {
    const int* cpm = at<const int>(local(c), me.off[DEEP_EP_IC_SEC_CPM]);
    for (int64_t i = gtid; i < R * C; i += threads) a.channel_prefix_matrix[i] = cpm[i];
  }
  if (a.send_head != nullptr) {
    const int* sh = at<const int>(local(c), me.off[DEEP_EP_IC_SEC_SEND_HEAD]);
    for (int64_t i = gtid; i < me.num_tokens * R; i += threads) a.send_head[i] = sh[i];
  }

  char* recv_x = static_cast<char*>(a.recv_x);
  uint32_t* recv_scales = static_cast<uint32_t*>(a.recv_scales);
  // Worst-case padding rows.
  for (int64_t row = real_rows + gwarp; row < a.num_rows; row += warps) {
    warp_zero(recv_x + row * rb, rb, lane);
    if (recv_scales != nullptr) {
      for (int64_t j = lane; j < S; j += 32) recv_scales[row * S + j] = 0;
    }
    for (int64_t j = lane; j < K; j += 32) {
      if (a.recv_topk_idx != nullptr) {
        if (a.topk_is_int64) static_cast<int64_t*>(a.recv_topk_idx)[row * K + j] = -1;
        else static_cast<int32_t*>(a.recv_topk_idx)[row * K + j] = -1;
      }
      if (a.recv_topk_weights != nullptr) a.recv_topk_weights[row * K + j] = 0.0f;
    }
    if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[row] = -1;
  }

  // Rows [0, lo) and [hi, real_rows): flat copies.
  if (((reinterpret_cast<uintptr_t>(recv_x) | static_cast<uintptr_t>(rb)) & 15) == 0) {
    const int4* s4 = reinterpret_cast<const int4*>(A.x);
    int4* d4 = reinterpret_cast<int4*>(recv_x);
    const int64_t n16 = rb / 16, lo16 = lo * n16, gap16 = gap * n16, total = moved * n16;
    for (int64_t base = gtid; base < total; base += threads * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * threads;
        if (i < total) v[u] = __ldcs(s4 + skip_gap(i, lo16, gap16));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * threads;
        if (i < total) d4[skip_gap(i, lo16, gap16)] = v[u];
      }
    }
  } else {
    const int64_t lob = lo * rb, gapb = gap * rb, total = moved * rb;
    for (int64_t i = gtid; i < total; i += threads) {
      const int64_t j = skip_gap(i, lob, gapb);
      recv_x[j] = A.x[j];
    }
  }
  if (recv_scales != nullptr) {
    const int64_t total = moved * S;
    for (int64_t i = gtid; i < total; i += threads) {
      const int64_t j = skip_gap(i, lo * S, gap * S);
      recv_scales[j] = A.scales[j];
    }
  }
  if (a.recv_topk_idx != nullptr || a.recv_topk_weights != nullptr) {
    const int64_t total = moved * K;
    for (int64_t i = gtid; i < total; i += threads) {
      const int64_t j = skip_gap(i, lo * K, gap * K);
      if (a.recv_topk_idx != nullptr) {
        if (a.topk_is_int64) static_cast<int64_t*>(a.recv_topk_idx)[j] = A.ids[j];
        else static_cast<int32_t*>(a.recv_topk_idx)[j] = static_cast<int32_t>(A.ids[j]);
      }
      if (a.recv_topk_weights != nullptr) a.recv_topk_weights[j] = A.weights[j];
    }
  }
  if (a.recv_src_idx != nullptr) {
    for (int64_t i = gtid; i < moved; i += threads) {
      const int64_t j = skip_gap(i, lo, gap);
      a.recv_src_idx[j] = A.src[j];
    }
  }
}

}  // namespace
}  // namespace ic
}  // namespace deep_ep

using namespace deep_ep;
using namespace deep_ep::ic;

extern "C" int deep_ep_ic_dispatch_push(const deep_ep_ic_ctx_t* ctx, const deep_ep_ic_dispatch_push_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_blocks < 1 || args->num_rows < 0 || args->num_tokens < 0 ||
      args->num_local_experts < 0 || (args->num_tokens > 0 && args->x == nullptr) ||
      (args->num_rows > 0 && args->recv_x == nullptr))
    return cudaErrorInvalidValue;
  const cudaStream_t s = as_stream(stream);
  if (ctx->num_ranks <= 2) dispatch_push_kernel<2><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  else if (ctx->num_ranks <= 4) dispatch_push_kernel<4><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  else dispatch_push_kernel<8><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  return cudaGetLastError();
}

extern "C" int deep_ep_ic_copy_out(const deep_ep_ic_ctx_t* ctx, const deep_ep_ic_pull_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_blocks < 1 || args->num_rows < 0 || (args->num_rows > 0 && args->recv_x == nullptr))
    return cudaErrorInvalidValue;
  copy_out_kernel<<<args->num_blocks, kThreads, 0, as_stream(stream)>>>(*ctx, *args);
  return cudaGetLastError();
}
