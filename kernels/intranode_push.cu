// intranode_push.cu: push model of the intranode normal-mode dispatch (deep_ep_kernels.h).
//
// push_dispatch (K3, after the notify / data barrier; the op's last kernel). Each block's
// warps are split: the first 16 - copy_warps push, the others copy out.
// Push warps: units of kPushTokens consecutive tokens of one channel, channels ascending (so
// channels complete in order), one warp per unit. Per token, lane d < R finds the token's output
// row on rank d (index words loaded one token ahead), then the warp reads the row of x once from
// local memory (8 16-byte loads per lane in flight) and stores each piece to every destination:
// remote ranks first, in the order rank + 1, rank + 2, ... (at any time the ranks mostly write to
// different peers), this rank's own outputs last. Row numbering and every side output are those of
// the pull model (intranode_pull.cu), so results are bit-identical. After each unit the warp counts
// its tokens in their channel's counter (local atomic, after ONE system fence per unit); the warp
// that completes a channel fences again and raises flag (me, channel) = this op's barrier epoch in
// every peer's window (st.release.sys).
// Copy warps: the rows rank s pushed for its channel ch are one contiguous range of this rank's
// receive area (output-row order); channel by channel, source by source, every copy warp waits for
// flag (s, ch) (ld.acquire.sys, globaltimer deadline that reports s) and copies its share of the
// range into the outputs with flat 16-byte copies, then the small arrays. So the local copy-out
// overlaps the NVLink push instead of following it behind a barrier.
#include <cstdint>

#include "intranode.cuh"

namespace deep_ep {
namespace ic {
namespace {

constexpr int kPushUnroll = 8;  // 16-byte loads in flight per lane (one row piece = 4 KiB)
// Tokens per push unit: one system fence per unit. A fence per token (the first version) stalled
// every push warp on its NVLink stores' completion once per 14 KB row.
constexpr int kPushTokens = 4;

__device__ __forceinline__ int4 ld_nc(const int4* p) { return __ldg(p); }

// One destination's copy of token t's side outputs (and its row when not 16-byte aligned): into
// this rank's outputs (own) or into rank d's receive area A, at row r. One warp.
__device__ __noinline__ void push_side(const dek_ic_dispatch_push_args_t& a, const RecvArea& A, int d, bool own, int64_t r,
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

__device__ void copy_out(const Ctx& c, const dek_ic_pull_args_t& a, int cw, int num_cw, uint64_t epoch);

}  // namespace

template <int kR>
__global__ void __launch_bounds__(kThreads) push_dispatch(const __grid_constant__ Ctx c,
                                                                 const __grid_constant__ dek_ic_dispatch_push_args_t a,
                                                                 const __grid_constant__ dek_ic_pull_args_t p) {
  __shared__ RecvArea s_area[kMaxRanks];
  __shared__ int64_t s_base[kMaxRanks];   // s_base[d]: first row of this rank's block on d
  __shared__ int64_t s_limit[kMaxRanks];  // rows d keeps
  __shared__ int s_fail;
  if (op_cancelled(c)) return;
  const int R = c.num_ranks, me = c.rank, tid = threadIdx.x, lane = tid & 31;
  const int* rpm = a.rpm_in != nullptr ? a.rpm_in : at<const int>(peer_local(c), kScrRpm);
  if (tid == 0) {
    s_fail = 0;
    for (int d = 0; d < R; ++d) {
      const Layout& L = scratch_layout(c, d);
      uint64_t need_kib = 0;
      if (L.recv_off == 0 || !recv_fits(L, pushed_rows(L, rpm[(R - 1) * R + d]), &need_kib)) {
        s_fail = 1;
        if (blockIdx.x == 0) {  // every rank finds the same: all skip this op
          report(c, DEK_IC_ERR_CAPACITY, d, DEK_IC_SITE_DISPATCH_PUSH, static_cast<int>(min(need_kib, uint64_t{INT32_MAX})),
                 static_cast<int>(min(c.window_bytes >> 10, uint64_t{INT32_MAX})));
          *at<volatile int>(peer_local(c), kScrOpBad) = 1;
        }
        break;
      }
      s_area[d] = recv_area(peer_window(c, d), L);
      s_base[d] = me > 0 ? rpm[(me - 1) * R + d] : 0;
      // Also never past the area (only an inconsistent cached handle could get there).
      s_limit[d] = min(L.recv_limit >= 0 ? L.recv_limit : INT64_MAX, L.recv_cap);
    }
    s_limit[me] = min(s_limit[me], a.num_rows);  // own outputs: never past their rows
  }
  __syncthreads();
  if (s_fail) return;
  const uint64_t epoch = *at<const uint64_t>(peer_local(c), kScrEpoch);  // the data barrier's: equal on all ranks
  const int warp = tid >> 5, copy_warps = a.copy_warps, push_warps = kWarps - copy_warps;
  if (warp >= push_warps) {
    copy_out(c, p, blockIdx.x * copy_warps + (warp - push_warps), gridDim.x * copy_warps, epoch);
    return;
  }

  const Layout& mine = scratch_layout(c, me);
  const int C = static_cast<int>(mine.num_channels);
  const int64_t N = a.num_tokens, rb = mine.row_bytes, S = mine.num_scales, K = mine.num_topk;
  const int64_t per = tokens_per_channel(N, C);
  const int* sh = a.send_head != nullptr ? a.send_head : at<const int>(peer_local(c), mine.off[DEK_IC_SEC_SEND_HEAD]);
  const int* cpm = a.channel_prefix_matrix != nullptr ? a.channel_prefix_matrix : at<const int>(peer_local(c), mine.off[DEK_IC_SEC_CPM]);
  const char* x = static_cast<const char*>(a.x);
  char* recv_x = static_cast<char*>(a.recv_x);
  // Window receive areas are 128-aligned and rows follow at multiples of rb.
  const bool vec = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(recv_x) | static_cast<uintptr_t>(rb)) & 15) == 0;
  const int n16 = static_cast<int>(rb / 16);
  const int64_t gwarp = static_cast<int64_t>(blockIdx.x) * push_warps + warp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * push_warps;
  int* done = at<int>(peer_local(c), kScrChanDone);  // zeroed by this op's stage kernel
  // Raises flag (me, ch) in every peer's window: all of this rank's rows of channel ch are there.
  auto signal = [&](int ch) {
    for (int d = 0; d < R; ++d) {
      if (d != me) st_release_sys(chan_flag(c, d, me, ch), epoch);
    }
  };
  if (gwarp == 0 && lane == 0) {  // channels without tokens are complete now
    for (int ch = 0; ch < C; ++ch) {
      if (min(per * (ch + 1), N) - min(per * ch, N) == 0) signal(ch);
    }
  }

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
  // Units of up to kPushTokens consecutive tokens of one channel, channels ascending; this warp
  // takes units gwarp, gwarp + warps, ... and fences once per unit (was once per token).
  const int64_t upc = per > 0 ? (per + kPushTokens - 1) / kPushTokens : 0, units = upc * C;
  for (int64_t unit = gwarp; unit < units; unit += warps) {
    const int ch = static_cast<int>(unit / upc);
    const int64_t t0 = ch * per + (unit % upc) * kPushTokens, t1 = min(min(t0 + kPushTokens, per * (ch + 1)), N);
    if (t0 >= t1) continue;
    int nx_s, nx_cp;
    load_idx(t0, nx_s, nx_cp);
    for (int64_t t = t0; t < t1; ++t) {
      const int cur_s = nx_s, cur_cp = nx_cp;
      if (t + 1 < t1) load_idx(t + 1, nx_s, nx_cp);
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
    // Count the unit's tokens in their channel; the warp that completes the channel publishes it.
    // The warp's stores are ordered before lane 0's fence by __syncwarp (fences are cumulative).
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      const int64_t in_channel = min(per * (ch + 1), N) - per * ch;
      const int n = static_cast<int>(t1 - t0);
      if (atomicAdd(done + ch, n) + n == in_channel) {
        __threadfence_system();  // every counted warp's rows before the flag
        signal(ch);
      }
    }
    __syncwarp();
  }
}

namespace {

// Copy warp cw of num_cw: receive area -> outputs, channel by channel as the senders complete them;
// also the padding rows and the handle outputs (no wait).
__device__ void copy_out(const Ctx& c, const dek_ic_pull_args_t& a, int cw, int num_cw, uint64_t epoch) {
  const int R = c.num_ranks, rank = c.rank, lane = threadIdx.x & 31;
  const Layout& me = scratch_layout(c, rank);
  const int* rpm = a.rpm_in != nullptr ? a.rpm_in : at<const int>(peer_local(c), kScrRpm);
  const int* rcpm = a.rcpm_in != nullptr ? a.rcpm_in : at<const int>(peer_local(c), kScrRcpm);
  const int C = static_cast<int>(me.num_channels);
  const int64_t rb = me.row_bytes, S = me.num_scales, K = me.num_topk;
  const int64_t received = max(rpm[(R - 1) * R + rank], 0);
  const int64_t real_rows = min(received, a.num_rows);
  const int64_t gtid = static_cast<int64_t>(cw) * 32 + lane, threads = static_cast<int64_t>(num_cw) * 32;
  const RecvArea A = recv_area(peer_local(c), me);

  write_handle_outputs(c, a, me, rpm, rcpm, gtid, threads);

  char* recv_x = static_cast<char*>(a.recv_x);
  uint32_t* recv_scales = static_cast<uint32_t*>(a.recv_scales);
  pad_rows(a, me, real_rows, cw, num_cw, lane);  // the worst-case padding rows

  const bool vec = ((reinterpret_cast<uintptr_t>(recv_x) | static_cast<uintptr_t>(rb)) & 15) == 0;
  const int64_t n16 = rb / 16;
  for (int ch = 0; ch < C; ++ch) {
    for (int v = 1; v < R; ++v) {
      const int s = (rank + v) % R;
      const int64_t base = s > 0 ? rpm[(s - 1) * R + rank] : 0;
      const int64_t lo = max(base + rcpm[s * C + ch], int64_t{0});
      const int64_t hi = min(ch + 1 < C ? base + rcpm[s * C + ch + 1] : static_cast<int64_t>(rpm[s * R + rank]), real_rows);
      if (lo >= hi) continue;  // nothing from s in this channel (or past the kept rows)
      if (!__all_sync(0xffffffffu, wait_flag(c, s, ch, epoch, DEK_IC_SITE_DISPATCH_RECV))) return;
      if (vec) {
        const int4* s4 = reinterpret_cast<const int4*>(A.x) + lo * n16;
        int4* d4 = reinterpret_cast<int4*>(recv_x) + lo * n16;
        const int64_t total = (hi - lo) * n16;
        for (int64_t i0 = gtid; i0 < total; i0 += threads * kUnroll) {
          int4 v4[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = i0 + u * threads;
            if (i < total) v4[u] = __ldcs(s4 + i);
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = i0 + u * threads;
            if (i < total) d4[i] = v4[u];
          }
        }
      } else {
        for (int64_t i = lo * rb + gtid; i < hi * rb; i += threads) recv_x[i] = A.x[i];
      }
      if (recv_scales != nullptr) {
        for (int64_t i = lo * S + gtid; i < hi * S; i += threads) recv_scales[i] = A.scales[i];
      }
      if (a.recv_topk_idx != nullptr || a.recv_topk_weights != nullptr) {
        for (int64_t i = lo * K + gtid; i < hi * K; i += threads) {
          if (a.recv_topk_idx != nullptr) {
            if (a.topk_is_int64) static_cast<int64_t*>(a.recv_topk_idx)[i] = A.ids[i];
            else static_cast<int32_t*>(a.recv_topk_idx)[i] = static_cast<int32_t>(A.ids[i]);
          }
          if (a.recv_topk_weights != nullptr) a.recv_topk_weights[i] = A.weights[i];
        }
      }
      if (a.recv_src_idx != nullptr) {
        for (int64_t i = lo + gtid; i < hi; i += threads) a.recv_src_idx[i] = A.src[i];
      }
    }
  }
}

}  // namespace
}  // namespace ic
}  // namespace deep_ep

using namespace deep_ep;
using namespace deep_ep::ic;

extern "C" int dek_ic_dispatch_push(const dek_ic_ctx_t* ctx, const dek_ic_dispatch_push_args_t* args,
                                        const dek_ic_pull_args_t* out, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || out == nullptr || args->num_blocks < 1 || args->num_rows < 0 || args->num_tokens < 0 ||
      args->num_local_experts < 0 || args->copy_warps < 1 || args->copy_warps >= kWarps ||
      (args->num_tokens > 0 && args->x == nullptr) || (args->num_rows > 0 && args->recv_x == nullptr) ||
      out->num_rows != args->num_rows || out->recv_x != args->recv_x)
    return cudaErrorInvalidValue;
  // Copy warps wait for peers' push warps: every block resident at once.
  int blocks = 0;
  DEEP_EP_TRY(resident_grid(ctx, args->num_blocks, &blocks));
  const cudaStream_t s = as_stream(stream);
  if (ctx->num_ranks <= 2) push_dispatch<2><<<blocks, kThreads, 0, s>>>(*ctx, *args, *out);
  else if (ctx->num_ranks <= 4) push_dispatch<4><<<blocks, kThreads, 0, s>>>(*ctx, *args, *out);
  else push_dispatch<8><<<blocks, kThreads, 0, s>>>(*ctx, *args, *out);
  return cudaGetLastError();
}
