// intranode_combine.cu: the combine kernels of the intranode normal mode (deep_ep_kernels.h).
// Combine is push, then local reduce: every rank stores the rows it holds into the windows of the
// ranks they came from, and every rank reduces its tokens from its own window.
//
// Split path (two kernels around the data barrier, DEEP_EP_INTRANODE_COMBINE=split):
// push_combine (K1) one warp per received row, written into the window of the rank it came from
// (remote 16-byte stores). reduce_combine (K3): one warp per token of this rank.
//
// Fused path (the default; one kernel after the start barrier, no data barrier):
// fused_combine overlaps the NVLink push with the local reduce. A data barrier made the
// reduce (~190 us at 20 SMs, SM-bound) wait for the whole push (~530 us, NVLink-bound); here the
// reduce of a channel starts as soon as every peer has pushed that channel. The rows a rank pushes
// back to source s for channel ch are one contiguous range of x (dispatch receive order: source,
// then channel, then token) and land contiguously in s's window, so one push unit is a flat copy of
// up to kPushRows rows. Push warps take units channel-major (channels complete in order) and fence
// ONCE per channel they worked on (not per row: a system fence per token is what made the push
// dispatch slow), then count the rows in a local per-(s, ch) counter; the warp that completes
// (s, ch) fences again and release-stores flag (rank, ch) = the start barrier's epoch into s's
// window. Reduce warps take chunks of kReduceTokens tokens from a local atomic queue in channel
// order, wait for flag (d, ch) of every peer d (ld.acquire.sys, globaltimer deadline reporting d),
// then reduce. This rank's own rows are read straight from x (no local copy). Push warps join the
// reduce queue once their units are done, so the split of a block's warps only sets the start.
//
// The reduce (both paths): lane d finds where rank d's row of the token is (index words loaded one
// token ahead), then the warp reduces 4 groups of 8 columns per lane at a time (1 at 8 ranks:
// registers), all loads issued first: fp32 adds in the fixed order bias_0, bias_1, ranks ascending
// (__fadd_rn: no contraction), one bf16 rounding at the end (cvt.rn.bf16x2; NaN groups via the bit
// trick). Same order and same rows on both paths, so the same bits as the CPU backend.
#include <cstdint>

#include "intranode.cuh"

namespace deep_ep {
namespace ic {
namespace {

__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], bf16_to_f32(w[i] & 0xffffu));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], bf16_to_f32(w[i] >> 16));
  }
}

// 8 bf16 of a local input: one 16-byte load when aligned, else 8 scalar loads.
__device__ __forceinline__ int4 load_bf16x8(const uint16_t* p, bool aligned) {
  if (aligned) return __ldg(reinterpret_cast<const int4*>(p));
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = static_cast<uint32_t>(p[2 * i]) | (static_cast<uint32_t>(p[2 * i + 1]) << 16);
  return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

// Two floats to packed bf16 (lo = a, hi = b): one cvt.rn.bf16x2.f32, round to nearest even with
// subnormals kept, the same bits as bf16_bits for every non-NaN input.
__device__ __forceinline__ uint32_t cvt_bf16x2(float a, float b) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}

// One output group of 8 columns: ((0 + bias_0) + bias_1) + x_d for d ascending, then bf16.
template <int kR>
__device__ __forceinline__ void reduce_group(int4* out, const uint16_t* b0, bool b0_aligned, const uint16_t* b1, bool b1_aligned,
                                             const int4 (&v)[kR], const int4* const (&src)[kR], int64_t g) {
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  if (b0 != nullptr) add_bf16x8(acc, load_bf16x8(b0 + g * 8, b0_aligned));
  if (b1 != nullptr) add_bf16x8(acc, load_bf16x8(b1 + g * 8, b1_aligned));
#pragma unroll
  for (int d = 0; d < kR; ++d) {
    if (src[d] != nullptr) add_bf16x8(acc, v[d]);
  }
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 8; ++i) nan |= acc[i] != acc[i];
  uint32_t packed[4];
  if (!nan) {
#pragma unroll
    for (int i = 0; i < 4; ++i) packed[i] = cvt_bf16x2(acc[2 * i], acc[2 * i + 1]);
  } else {  // NaN payloads as crate::numerics::bf16::from_f32 keeps them
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      packed[i] = static_cast<uint32_t>(bf16_bits(acc[2 * i])) | (static_cast<uint32_t>(bf16_bits(acc[2 * i + 1])) << 16);
    }
  }
  out[g] = make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]), static_cast<int>(packed[3]));
}

// Where this rank's rows start in every rank s's window (s_base[s]) and where the weights are
// there (s_woff[s]). Every rank computes every window's need from the same rank_prefix_matrix:
// if one does not fit, every rank finds it, reports it (block 0), cancels the op and returns
// false, so no rank pushes anything. One thread.
__device__ bool combine_plan(const Ctx& c, const int* rpm, int64_t rb, int64_t K, int64_t* s_base, uint64_t* s_woff) {
  const int R = c.num_ranks, me = c.rank;
  for (int s = 0; s < R; ++s) {
    int64_t pairs = 0, base = 0;
    bool bad = false;
    for (int d = 0; d < R; ++d) {
      const int64_t k = sent_rows(rpm, R, s, d);
      bad |= k < 0;
      if (d < me) base += k;
      pairs += k;
    }
    s_base[s] = base;
    s_woff[s] = combine_weights_off(pairs, rb);
    const uint64_t need = s_woff[s] + static_cast<uint64_t>(pairs * K) * 4;
    if (bad || need > c.window_bytes) {
      if (blockIdx.x == 0) {  // every rank finds the same: all skip this combine
        report(c, DEK_IC_ERR_CAPACITY, s, DEK_IC_SITE_COMBINE_START, static_cast<int>(min(need >> 10, uint64_t{INT32_MAX})),
               static_cast<int>(min(c.window_bytes >> 10, uint64_t{INT32_MAX})));
        *at<volatile int>(peer_local(c), kScrOpBad) = 1;
      }
      return false;
    }
  }
  return true;
}

// One token n: out[n] from the rows src[d] (nullptr: rank d did not get the token), weights from
// wsrc[d] (K floats each). One warp.
template <int kR>
__device__ __forceinline__ void reduce_token(const dek_ic_combine_args_t& a, int64_t n, const int4* const (&src)[kR],
                                             const float* const (&wsrc)[kR], bool b0_aligned, bool b1_aligned, int lane) {
  const int64_t H = a.hidden, groups = H / 8;
  const int K = a.num_topk;
  const uint16_t* b0 = a.bias_0 != nullptr ? a.bias_0 + n * H : nullptr;
  const uint16_t* b1 = a.bias_1 != nullptr ? a.bias_1 + n * H : nullptr;
  int4* out = reinterpret_cast<int4*>(a.out + n * H);  // 16-byte aligned: H % 8 == 0
  // kG groups of 8 columns per lane and iteration, every source's loads issued first.
  constexpr int kG = kR <= 4 ? 4 : 1;
  for (int64_t gb = lane; gb < groups; gb += 32 * kG) {
    int4 v[kG][kR];
#pragma unroll
    for (int u = 0; u < kG; ++u) {
      const int64_t g = gb + 32 * u;
      if (g < groups) {
#pragma unroll
        for (int d = 0; d < kR; ++d) {
          if (src[d] != nullptr) v[u][d] = __ldcg(src[d] + g);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kG; ++u) {
      const int64_t g = gb + 32 * u;
      if (g < groups) reduce_group<kR>(out, b0, b0_aligned, b1, b1_aligned, v[u], src, g);
    }
  }
  if (a.out_weights != nullptr) {
    for (int j = lane; j < K; j += 32) {
      float w = 0.0f;
#pragma unroll
      for (int d = 0; d < kR; ++d) {
        if (src[d] != nullptr && wsrc[d] != nullptr) w = __fadd_rn(w, __ldcg(wsrc[d] + j));
      }
      a.out_weights[n * K + j] = w;
    }
  }
}

// Lane d < R: the index words of token n for rank d (is_token_in_rank, channel prefix,
// send_head); loaded one token ahead so their round trip overlaps the previous token's work.
__device__ __forceinline__ void load_idx(const dek_ic_combine_args_t& a, int R, int64_t per, int64_t n, int lane, int& in, int& cp,
                                         int& sh) {
  in = 0;
  cp = 0;
  sh = -1;
  if (lane < R && n < a.num_tokens) {
    const int64_t ch = n / per;
    in = reinterpret_cast<const unsigned char*>(a.is_token_in_rank)[n * R + lane];
    if (ch > 0) cp = a.channel_prefix_matrix[lane * a.num_channels + ch - 1];
    sh = a.send_head[n * R + lane];
  }
}

// Lane d < R: the position of the token's row among the rows rank d holds of this rank's tokens
// (its send order to d), or -1.
__device__ __forceinline__ int64_t row_pos(int in, int cp, int sh, const int64_t* s_count, int R, int lane) {
  if (lane >= R || in == 0) return -1;
  const int64_t pos = static_cast<int64_t>(cp) + sh;
  return pos >= 0 && pos < s_count[lane] ? pos : -1;
}

}  // namespace

// ---- split path -------------------------------------------------------------------------------
// K1 of combine: this rank's received rows go back into the windows of the ranks they came from.
// kT: threads per block, kThreads or 1024 (DEEP_EP_INTRANODE_COMBINE_THREADS: twice the warps
// storing over NVLink per SM, to measure whether the push rate follows the number of warps).
template <int kT>
__global__ void __launch_bounds__(kT) push_combine(const __grid_constant__ Ctx c, const __grid_constant__ dek_ic_push_args_t a) {
  __shared__ int s_rpm[kMaxRanks * kMaxRanks];
  __shared__ int64_t s_base[kMaxRanks];    // s_base[s]: where this rank's rows start in s's window
  __shared__ uint64_t s_woff[kMaxRanks];   // weights offset in s's window
  __shared__ int64_t s_vstart[kMaxRanks + 1];  // rows in the order of sources me, me + 1, ...
  __shared__ int s_fail;
  const Layout& L = a.layout;
  const int R = c.num_ranks, me = c.rank, tid = threadIdx.x, lane = tid & 31;
  if (blockIdx.x == 0 && tid < DEK_IC_LAYOUT_BYTES / 8) {  // gathered by the data barrier
    const uint64_t* words = reinterpret_cast<const uint64_t*>(&L);
    at<uint64_t>(peer_local(c), next_header_slot(c))[tid] = tid < sizeof(Layout) / 8 ? words[tid] : 0;
  }
  for (int i = tid; i < R * R; i += blockDim.x) s_rpm[i] = a.rank_prefix_matrix[i];
  __syncthreads();
  const int64_t rb = L.row_bytes, K = L.num_topk;
  if (tid == 0) s_fail = !combine_plan(c, s_rpm, rb, K, s_base, s_woff);
  if (tid == 0 && !s_fail) {
    int64_t acc = 0;
    for (int v = 0; v < R; ++v) {
      s_vstart[v] = acc;
      acc += sent_rows(s_rpm, R, (me + v) % R, me);
    }
    s_vstart[R] = acc;
  }
  __syncthreads();
  if (s_fail) return;
  const int64_t gwarp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + tid) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const char* x = static_cast<const char*>(a.x);
  // Rows [rpm[s-1][me], rpm[s][me]) of x came from s. They are walked source by source starting
  // with s = me, then me + 1, ...: at any time the ranks mostly write to different ranks (walking
  // s = 0, 1, ... on every rank made all ranks write into one window at a time).
  for (int64_t q = gwarp; q < s_vstart[R]; q += warps) {
    int v = 0;
    while (v + 1 < R && q >= s_vstart[v + 1]) ++v;
    const int s = (me + v) % R;
    const int64_t j = q - s_vstart[v];
    const int64_t r = (s > 0 ? s_rpm[(s - 1) * R + me] : 0) + j;
    if (r >= a.num_rows) continue;  // inconsistent handle: x has fewer rows
    const int64_t row = s_base[s] + j;
    char* dst = peer_window(c, s);
    warp_copy(dst + DEK_IC_CONTROL_BYTES + row * rb, x + r * rb, rb, lane);
    if (a.topk_weights != nullptr) {
      float* w = reinterpret_cast<float*>(dst + s_woff[s]) + row * K;
      for (int64_t i = lane; i < K; i += 32) w[i] = a.topk_weights[r * K + i];
    }
  }
  __threadfence_system();  // the remote writes are performed before the data barrier signals
}

// K3 of combine, kR >= num_ranks (register arrays sized for 2, 4 or 8 ranks). Reads only this
// rank's window, where every rank pushed its rows.
template <int kR>
__global__ void __launch_bounds__(kThreads) reduce_combine(const __grid_constant__ Ctx c, const __grid_constant__ dek_ic_combine_args_t a) {
  __shared__ int64_t s_base[kMaxRanks];  // s_base[d]: where rank d's rows start in this window
  __shared__ int64_t s_count[kMaxRanks];
  __shared__ uint64_t s_woff;
  if (op_cancelled(c)) return;
  const int R = c.num_ranks, rank = c.rank, lane = threadIdx.x & 31;
  const int K = a.num_topk;
  const int64_t rb = static_cast<int64_t>(a.hidden) * 2, n_tokens = a.num_tokens;
  if (threadIdx.x == 0) {
    int64_t base = 0;
    for (int d = 0; d < R; ++d) {
      s_base[d] = base;
      s_count[d] = sent_rows(a.rank_prefix_matrix, R, rank, d);
      base += s_count[d];
    }
    s_woff = combine_weights_off(base, rb);
  }
  __syncthreads();
  const int64_t per = tokens_per_channel(n_tokens, a.num_channels);
  const int64_t gwarp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const bool b0_aligned = (reinterpret_cast<uintptr_t>(a.bias_0) & 15) == 0;
  const bool b1_aligned = (reinterpret_cast<uintptr_t>(a.bias_1) & 15) == 0;
  char* me = peer_local(c);
  int nx_in, nx_cp, nx_sh;
  load_idx(a, R, per, gwarp, lane, nx_in, nx_cp, nx_sh);
  for (int64_t n = gwarp; n < n_tokens; n += warps) {
    const int cur_in = nx_in, cur_cp = nx_cp, cur_sh = nx_sh;
    load_idx(a, R, per, n + warps, lane, nx_in, nx_cp, nx_sh);
    const int64_t pos = row_pos(cur_in, cur_cp, cur_sh, s_count, R, lane);
    const int64_t row = pos >= 0 ? s_base[lane] + pos : -1;
    const int4* src[kR];
    const float* wsrc[kR];
#pragma unroll
    for (int d = 0; d < kR; ++d) {
      const int64_t r = __shfl_sync(0xffffffffu, row, d);
      const bool has = d < R && r >= 0;
      src[d] = has ? reinterpret_cast<const int4*>(me + DEK_IC_CONTROL_BYTES + r * rb) : nullptr;
      wsrc[d] = has ? reinterpret_cast<const float*>(me + s_woff) + r * K : nullptr;
    }
    reduce_token<kR>(a, n, src, wsrc, b0_aligned, b1_aligned, lane);
  }
}

namespace {

// ---- fused path ----------------------------------------------------------------------------
constexpr int kPushRows = 8;      // rows per push unit: one flat copy of up to 8 rows (112 KiB at 7168)
constexpr int kReduceTokens = 4;  // tokens per reduce unit (queue round trips vs. the tail)

// Rows [lo, hi) of x that this rank pushes back to s for channel ch, and xb = s's first row in x.
// Clipped to the rows s sent and to x's rows: an inconsistent handle cannot write past the area of
// s's window that the capacity check counted.
__device__ __forceinline__ void push_range(const int* rpm, const int* rcpm, int R, int C, int me, int s, int ch, int64_t num_rows,
                                           int64_t& xb, int64_t& lo, int64_t& hi) {
  xb = s > 0 ? rpm[(s - 1) * R + me] : 0;
  const int64_t xe = max(static_cast<int64_t>(rpm[s * R + me]), xb);
  lo = min(max(xb + rcpm[s * C + ch], xb), xe);
  hi = ch + 1 < C ? min(max(xb + rcpm[s * C + ch + 1], lo), xe) : xe;
  hi = min(hi, max(num_rows, int64_t{0}));
  lo = min(lo, hi);
}

// Push warps: units (channel, peer s = me + v, chunk of kPushRows rows) in that order; this warp
// takes units gwarp, gwarp + warps, ... A warp fences once per channel it worked on, then counts
// its rows per peer; the count that completes (s, ch) raises flag (me, ch) in s's window. kU:
// 16-byte loads in flight per lane (a template argument of the kernel, so the registers of the
// deeper copy do not change the other instantiation's reduce loop).
template <int kU>
__device__ void push_rows(const Ctx& c, const dek_ic_push_args_t& p, int C, const int* rpm, const int64_t* s_base,
                          const uint64_t* s_woff, uint64_t epoch, int64_t gwarp, int64_t warps, int lane) {
  const int R = c.num_ranks, me = c.rank;
  if (R < 2) return;
  const int* rcpm = p.recv_channel_prefix_matrix;
  const int64_t rb = p.layout.row_bytes, K = p.layout.num_topk;
  const char* x = static_cast<const char*>(p.x);
  int* done = at<int>(peer_local(c), kScrPushDone);
  if (gwarp == 0) {  // ranges without rows are complete now
    for (int i = lane; i < C * R; i += 32) {
      const int ch = i / R, s = i % R;
      int64_t xb, lo, hi;
      push_range(rpm, rcpm, R, C, me, s, ch, p.num_rows, xb, lo, hi);
      if (s != me && lo == hi) st_release_sys(chan_flag(c, s, me, ch), epoch);
    }
  }
  int pend = 0, pend_ch = -1;  // lane v: rows pushed to me + v in channel pend_ch, not yet counted
  auto flush = [&]() {
    __syncwarp();  // the warp's stores, then lane 0's fence (cumulative) before the counts
    if (lane == 0) __threadfence_system();
    for (int v = 1; v < R; ++v) {
      const int cnt = __shfl_sync(0xffffffffu, pend, v);
      if (lane == 0 && cnt > 0) {
        const int s = (me + v) % R;
        int64_t xb, lo, hi;
        push_range(rpm, rcpm, R, C, me, s, pend_ch, p.num_rows, xb, lo, hi);
        if (atomicAdd(done + s * kMaxChannels + pend_ch, cnt) + cnt == hi - lo) {
          __threadfence_system();  // every counted warp's rows before the flag
          st_release_sys(chan_flag(c, s, me, pend_ch), epoch);
        }
      }
    }
    __syncwarp();
    pend = 0;
  };
  int ch = 0, v = 1, s = (me + 1) % R;
  int64_t xb, lo, hi, first = 0;  // first: index of the current range's first unit
  push_range(rpm, rcpm, R, C, me, s, ch, p.num_rows, xb, lo, hi);
  for (int64_t u = gwarp;; u += warps) {
    bool end = false;
    while (!end && u >= first + (hi - lo + kPushRows - 1) / kPushRows) {
      first += (hi - lo + kPushRows - 1) / kPushRows;
      if (++v == R) {
        v = 1;
        end = ++ch == C;
      }
      s = (me + v) % R;
      if (!end) push_range(rpm, rcpm, R, C, me, s, ch, p.num_rows, xb, lo, hi);
    }
    if (end) break;
    if (pend_ch != ch) {
      if (pend_ch >= 0) flush();
      pend_ch = ch;
    }
    const int64_t a0 = lo + (u - first) * kPushRows, a1 = min(a0 + kPushRows, hi);
    char* dst = peer_window(c, s);
    const int64_t row = s_base[s] + (a0 - xb);  // rows follow each other in both windows
    warp_copy<kU>(dst + DEK_IC_CONTROL_BYTES + row * rb, x + a0 * rb, (a1 - a0) * rb, lane);
    if (p.topk_weights != nullptr) {
      float* w = reinterpret_cast<float*>(dst + s_woff[s]) + row * K;
      for (int64_t i = lane; i < (a1 - a0) * K; i += 32) w[i] = p.topk_weights[a0 * K + i];
    }
    if (lane == v) pend += static_cast<int>(a1 - a0);
  }
  if (pend_ch >= 0) flush();
}

// Reduce warps (and push warps once done): units of kReduceTokens tokens of one channel from the
// local queue, channels ascending; before the first unit of a channel, wait for every peer's flag.
template <int kR>
__device__ void reduce_rows(const Ctx& c, const dek_ic_push_args_t& p, const dek_ic_combine_args_t& a, const int* rpm,
                            const int64_t* s_rbase, const int64_t* s_count, uint64_t epoch, int lane) {
  const int R = c.num_ranks, me = c.rank, C = a.num_channels;
  const int64_t rb = static_cast<int64_t>(a.hidden) * 2, N = a.num_tokens, K = a.num_topk;
  const int64_t per = tokens_per_channel(N, C);
  if (per == 0) return;
  const int64_t upc = (per + kReduceTokens - 1) / kReduceTokens, total = upc * C;
  char* win = peer_local(c);
  const float* wwin = reinterpret_cast<const float*>(win + combine_weights_off(s_rbase[R - 1] + s_count[R - 1], rb));
  const int64_t xb = me > 0 ? rpm[(me - 1) * R + me] : 0;  // this rank's own rows in x
  const char* x = static_cast<const char*>(p.x);
  const bool b0_aligned = (reinterpret_cast<uintptr_t>(a.bias_0) & 15) == 0;
  const bool b1_aligned = (reinterpret_cast<uintptr_t>(a.bias_1) & 15) == 0;
  int* next = at<int>(win, kScrCombineNext);  // zeroed by the start barrier
  auto grab = [&]() {
    int u = 0;
    if (lane == 0) u = atomicAdd(next, 1);
    return static_cast<int64_t>(__shfl_sync(0xffffffffu, u, 0));
  };
  int ready = -1;  // the channel whose flags this warp has seen (units come in ascending order)
  for (int64_t u = grab(); u < total;) {
    const int64_t nu = grab();  // the next unit's round trip overlaps this one
    const int ch = static_cast<int>(u / upc);
    const int64_t t0 = ch * per + (u % upc) * kReduceTokens;
    const int64_t t1 = min(min(t0 + kReduceTokens, (ch + 1) * per), N);
    if (t0 < t1 && ch != ready) {
      bool ok = true;
      for (int d = 0; d < R && ok; ++d) {
        if (d != me) ok = wait_flag(c, d, ch, epoch, DEK_IC_SITE_COMBINE_RECV);
      }
      if (!__all_sync(0xffffffffu, ok)) return;
      ready = ch;
    }
    int nx_in = 0, nx_cp = 0, nx_sh = -1;
    if (t0 < t1) load_idx(a, R, per, t0, lane, nx_in, nx_cp, nx_sh);
    for (int64_t n = t0; n < t1; ++n) {
      const int cur_in = nx_in, cur_cp = nx_cp, cur_sh = nx_sh;
      if (n + 1 < t1) load_idx(a, R, per, n + 1, lane, nx_in, nx_cp, nx_sh);
      const int64_t pos = row_pos(cur_in, cur_cp, cur_sh, s_count, R, lane);
      const int4* src[kR];
      const float* wsrc[kR];
#pragma unroll
      for (int d = 0; d < kR; ++d) {
        const int64_t q = __shfl_sync(0xffffffffu, pos, d);
        src[d] = nullptr;
        wsrc[d] = nullptr;
        if (d < R && q >= 0) {
          if (d == me) {  // own rows: straight from x (what the split path copies into the window)
            const int64_t r = xb + q;
            if (r < p.num_rows) {
              src[d] = reinterpret_cast<const int4*>(x + r * rb);
              wsrc[d] = p.topk_weights != nullptr ? p.topk_weights + r * K : nullptr;
            }
          } else {
            const int64_t r = s_rbase[d] + q;
            src[d] = reinterpret_cast<const int4*>(win + DEK_IC_CONTROL_BYTES + r * rb);
            wsrc[d] = wwin + r * K;
          }
        }
      }
      reduce_token<kR>(a, n, src, wsrc, b0_aligned, b1_aligned, lane);
    }
    u = nu;
  }
}

}  // namespace

template <int kR, int kU>
__global__ void __launch_bounds__(kThreads) fused_combine(const __grid_constant__ Ctx c, const __grid_constant__ dek_ic_push_args_t p,
                                                                 const __grid_constant__ dek_ic_combine_args_t a) {
  __shared__ int s_rpm[kMaxRanks * kMaxRanks];
  __shared__ int64_t s_base[kMaxRanks];   // where this rank's rows start in s's window
  __shared__ uint64_t s_woff[kMaxRanks];  // weights offset in s's window
  __shared__ int64_t s_rbase[kMaxRanks];  // where rank d's rows start in this window
  __shared__ int64_t s_count[kMaxRanks];  // rows rank d holds of this rank's tokens
  __shared__ int s_fail;
  if (op_cancelled(c)) return;  // a barrier timed out, or the ranks run different ops
  const int R = c.num_ranks, me = c.rank, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < R * R; i += blockDim.x) s_rpm[i] = p.rank_prefix_matrix[i];
  __syncthreads();
  if (tid == 0) {
    s_fail = !combine_plan(c, s_rpm, p.layout.row_bytes, p.layout.num_topk, s_base, s_woff);
    int64_t base = 0;
    for (int d = 0; d < R; ++d) {
      s_rbase[d] = base;
      s_count[d] = sent_rows(s_rpm, R, me, d);
      base += s_count[d];
    }
  }
  __syncthreads();
  if (s_fail) return;
  const uint64_t epoch = ld_volatile(at<const uint64_t>(peer_local(c), kScrEpoch));  // the start barrier's: equal on all ranks
  const int push_warps = kWarps - p.reduce_warps;
  if (warp < push_warps) {
    push_rows<kU>(c, p, a.num_channels, s_rpm, s_base, s_woff, epoch, static_cast<int64_t>(blockIdx.x) * push_warps + warp,
              static_cast<int64_t>(gridDim.x) * push_warps, lane);
  }
  reduce_rows<kR>(c, p, a, s_rpm, s_rbase, s_count, epoch, lane);
}
}  // namespace ic
}  // namespace deep_ep

using namespace deep_ep;
using namespace deep_ep::ic;


namespace {
bool combine_args_ok(const dek_ic_combine_args_t* args) {
  return args != nullptr && args->num_blocks >= 1 && args->num_tokens >= 0 && args->hidden >= 0 && args->hidden % 8 == 0 &&
         args->num_channels >= 1 && args->num_topk >= 0 &&
         (args->num_tokens == 0 || (args->out != nullptr && args->rank_prefix_matrix != nullptr && args->channel_prefix_matrix != nullptr &&
                                    args->is_token_in_rank != nullptr && args->send_head != nullptr)) &&
         (reinterpret_cast<uintptr_t>(args->out) & 15) == 0;
}
}  // namespace

extern "C" int dek_ic_combine_fused(const dek_ic_ctx_t* ctx, const dek_ic_push_args_t* push,
                                        const dek_ic_combine_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || push == nullptr || !combine_args_ok(args) || push->num_rows < 0 || push->layout.row_bytes != 2 * int64_t{args->hidden} ||
      push->layout.num_topk != args->num_topk || (push->num_rows > 0 && push->x == nullptr) || push->rank_prefix_matrix == nullptr ||
      push->recv_channel_prefix_matrix == nullptr || args->num_channels > kMaxChannels || push->reduce_warps < 1 ||
      push->reduce_warps >= kWarps)
    return cudaErrorInvalidValue;
  // Reduce warps wait for other GPUs' push warps: every block resident at once.
  int blocks = 0;
  DEEP_EP_TRY(resident_grid(ctx, args->num_blocks, &blocks));
  const cudaStream_t s = as_stream(stream);
  const bool deep = push->push_unroll >= 16;
  if (ctx->num_ranks <= 2) {
    if (deep) fused_combine<2, 16><<<blocks, kThreads, 0, s>>>(*ctx, *push, *args);
    else fused_combine<2, 8><<<blocks, kThreads, 0, s>>>(*ctx, *push, *args);
  } else if (ctx->num_ranks <= 4) {
    if (deep) fused_combine<4, 16><<<blocks, kThreads, 0, s>>>(*ctx, *push, *args);
    else fused_combine<4, 8><<<blocks, kThreads, 0, s>>>(*ctx, *push, *args);
  } else {
    if (deep) fused_combine<8, 16><<<blocks, kThreads, 0, s>>>(*ctx, *push, *args);
    else fused_combine<8, 8><<<blocks, kThreads, 0, s>>>(*ctx, *push, *args);
  }
  return cudaGetLastError();
}

extern "C" int dek_ic_combine_push(const dek_ic_ctx_t* ctx, const dek_ic_push_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_blocks < 1 || args->num_rows < 0 || args->layout.row_bytes < 0 ||
      args->layout.num_topk < 0 || (args->num_rows > 0 && args->x == nullptr) || args->rank_prefix_matrix == nullptr)
    return cudaErrorInvalidValue;
  if (args->threads >= 1024) push_combine<1024><<<args->num_blocks, 1024, 0, as_stream(stream)>>>(*ctx, *args);
  else push_combine<kThreads><<<args->num_blocks, kThreads, 0, as_stream(stream)>>>(*ctx, *args);
  return cudaGetLastError();
}

extern "C" int dek_ic_combine(const dek_ic_ctx_t* ctx, const dek_ic_combine_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || !combine_args_ok(args)) return cudaErrorInvalidValue;
  const cudaStream_t s = as_stream(stream);
  if (ctx->num_ranks <= 2) reduce_combine<2><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  else if (ctx->num_ranks <= 4) reduce_combine<4><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  else reduce_combine<8><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  return cudaGetLastError();
}
