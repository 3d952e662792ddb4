// intranode_pull.cu: the data-moving kernels of the intranode normal-mode ops (besides staging).
// The K3 kernels run after the data barrier, so every peer's staged sections are complete and stay
// unchanged until this rank's next op starts (the next op begins with a barrier); push_kernel runs
// after the start barrier, when every peer is done with its window. Peer memory is read with
// L2-only loads (__ldcg); nothing here waits on anything.
//
// pull_kernel (dispatch, cached dispatch): one warp per task of kTaskTokens consecutive tokens of
// one source; lanes read the tokens' send_head entries for this rank, compute their destination
// rows, and the warp copies the selected rows one after the other (16-byte loads, 16 in flight per
// lane, the row's scales / top-k words loaded before its data).
// push_kernel (combine K1): one warp per received row, written into the window of the rank it came
// from (remote 16-byte stores). combine_kernel (K3): one warp per token of this rank; lane d finds
// where rank d pushed the token's row in this rank's window (index words loaded one token ahead),
// then the warp reduces 4 groups of 8 columns per lane at a time (1 at 8 ranks: registers), all
// loads issued first: fp32 adds in the fixed order bias_0, bias_1, ranks ascending (__fadd_rn: no
// contraction), one bf16 rounding at the end (cvt.rn.bf16x2; NaN groups via the bit trick).
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
// 16-byte loads in flight per lane in the row copy: 8 KiB per warp, so a 7168-wide BF16 row takes
// two round trips and an FP8 row one (at 20 SMs the pull is bound by bytes in flight, not by the
// link: bench/NOTES.md, session 4).
constexpr int kPullUnroll = 16;

__global__ void __launch_bounds__(kThreads) pull_kernel(const __grid_constant__ Ctx c, const __grid_constant__ deep_ep_ic_pull_args_t a) {
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
  const int* rpm = a.rpm_in != nullptr ? a.rpm_in : at<const int>(local(c), kScrRpm);
  const int* rcpm = a.rcpm_in != nullptr ? a.rcpm_in : at<const int>(local(c), kScrRcpm);
  const int C = static_cast<int>(me.num_channels);
  const int64_t rb = me.row_bytes, S = me.num_scales, K = me.num_topk, el = a.num_local_experts;
  const int64_t received = max(rpm[(R - 1) * R + rank], 0);
  const int64_t real_rows = min(received, a.num_rows);
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gwarp = gtid >> 5, warps = threads >> 5;

  // Handle outputs (dispatch): this rank's notify results and its own staged send side.
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

  // Received rows.
  const int64_t total = s_task_start[R];
  for (int64_t task = gwarp; task < total; task += warps) {
    int v = 0;
    while (v + 1 < R && s_task_start[v + 1] <= task) ++v;
    const int s = (rank + v) % R;
    const Layout& L = s_layout[s];
    const int64_t first = (task - s_task_start[v]) * kTaskTokens;
    const int64_t per = tokens_per_channel(L.num_tokens, C);
    const char* src = window(c, s);
    const int64_t t = first + lane;
    int64_t row = -1;
    if (lane < kTaskTokens && t < L.num_tokens) {
      const int sh = __ldcg(at<const int>(const_cast<char*>(src), L.off[DEEP_EP_IC_SEC_SEND_HEAD]) + t * R + rank);
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
      const uint32_t* sc = recv_scales != nullptr ? reinterpret_cast<const uint32_t*>(src + L.off[DEEP_EP_IC_SEC_SCALES]) + tok * S : nullptr;
      const long long* ids = reinterpret_cast<const long long*>(src + L.off[DEEP_EP_IC_SEC_TOPK]) + tok * K;
      const float* w = reinterpret_cast<const float*>(src + L.off[DEEP_EP_IC_SEC_WEIGHTS]) + tok * K;
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
      warp_copy<kPullUnroll>(recv_x + r * rb, src + L.off[DEEP_EP_IC_SEC_X] + tok * rb, rb, lane);
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

// K1 of combine: this rank's received rows go back into the windows of the ranks they came from.
__global__ void __launch_bounds__(kThreads) push_kernel(const __grid_constant__ Ctx c, const __grid_constant__ deep_ep_ic_push_args_t a) {
  __shared__ int s_rpm[kMaxRanks * kMaxRanks];
  __shared__ int64_t s_base[kMaxRanks];    // s_base[s]: where this rank's rows start in s's window
  __shared__ uint64_t s_woff[kMaxRanks];   // weights offset in s's window
  __shared__ int64_t s_vstart[kMaxRanks + 1];  // rows in the order of sources me, me + 1, ...
  __shared__ int s_fail;
  const Layout& L = a.layout;
  const int R = c.num_ranks, me = c.rank, tid = threadIdx.x, lane = tid & 31;
  if (blockIdx.x == 0 && tid < DEEP_EP_IC_LAYOUT_BYTES / 8) {
    const uint64_t* words = reinterpret_cast<const uint64_t*>(&L);
    at<uint64_t>(local(c), kHeaderOff)[tid] = tid < sizeof(Layout) / 8 ? words[tid] : 0;
  }
  for (int i = tid; i < R * R; i += blockDim.x) s_rpm[i] = a.rank_prefix_matrix[i];
  __syncthreads();
  const int64_t rb = L.row_bytes, K = L.num_topk;
  if (tid == 0) {
    s_fail = 0;
    for (int s = 0; s < R; ++s) {
      int64_t pairs = 0, base = 0;
      bool bad = false;
      for (int d = 0; d < R; ++d) {
        const int64_t k = sent_rows(s_rpm, R, s, d);
        bad |= k < 0;
        if (d < me) base += k;
        pairs += k;
      }
      s_base[s] = base;
      s_woff[s] = combine_weights_off(pairs, rb);
      const uint64_t need = s_woff[s] + static_cast<uint64_t>(pairs * K) * 4;
      if (bad || need > c.window_bytes) {
        s_fail = 1;
        if (blockIdx.x == 0) {  // every rank finds the same: all skip this combine
          report(c, DEEP_EP_IC_ERR_CAPACITY, s, DEEP_EP_IC_SITE_COMBINE_START, static_cast<int>(min(need >> 10, uint64_t{INT32_MAX})),
                 static_cast<int>(min(c.window_bytes >> 10, uint64_t{INT32_MAX})));
          *at<volatile int>(local(c), kScrOpBad) = 1;
        }
        break;
      }
    }
  }
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
    char* dst = window(c, s);
    warp_copy(dst + DEEP_EP_IC_CONTROL_BYTES + row * rb, x + r * rb, rb, lane);
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
__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ Ctx c, const __grid_constant__ deep_ep_ic_combine_args_t a) {
  __shared__ int64_t s_base[kMaxRanks];  // s_base[d]: where rank d's rows start in this window
  __shared__ int64_t s_count[kMaxRanks];
  __shared__ uint64_t s_woff;
  if (op_cancelled(c)) return;
  const int R = c.num_ranks, rank = c.rank, lane = threadIdx.x & 31;
  const int C = a.num_channels, K = a.num_topk;
  const int64_t H = a.hidden, groups = H / 8, n_tokens = a.num_tokens, rb = H * 2;
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
  const int64_t per = tokens_per_channel(n_tokens, C);
  const int64_t gwarp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const unsigned char* in_rank = reinterpret_cast<const unsigned char*>(a.is_token_in_rank);
  const bool b0_aligned = (reinterpret_cast<uintptr_t>(a.bias_0) & 15) == 0;
  const bool b1_aligned = (reinterpret_cast<uintptr_t>(a.bias_1) & 15) == 0;
  char* me = local(c);

  // Lane d < R: the index words of token n for rank d (is_token_in_rank, channel prefix,
  // send_head), loaded one token ahead so their round trip overlaps the previous token's work.
  auto load_idx = [&](int64_t n, int& in, int& cp, int& sh) {
    in = 0;
    cp = 0;
    sh = -1;
    if (lane < R && n < n_tokens) {
      const int64_t ch = n / per;
      in = in_rank[n * R + lane];
      if (ch > 0) cp = a.channel_prefix_matrix[lane * C + ch - 1];
      sh = a.send_head[n * R + lane];
    }
  };
  int nx_in, nx_cp, nx_sh;
  load_idx(gwarp, nx_in, nx_cp, nx_sh);
  for (int64_t n = gwarp; n < n_tokens; n += warps) {
    // Lane d: where rank d pushed this token's row (position in this rank's send order to d).
    const int cur_in = nx_in, cur_cp = nx_cp, cur_sh = nx_sh;
    load_idx(n + warps, nx_in, nx_cp, nx_sh);
    int64_t row = -1;
    if (lane < R && cur_in != 0) {
      const int64_t pos = static_cast<int64_t>(cur_cp) + cur_sh;
      if (pos >= 0 && pos < s_count[lane]) row = s_base[lane] + pos;
    }
    int64_t rows[kR];
    const int4* src[kR];
#pragma unroll
    for (int d = 0; d < kR; ++d) {
      rows[d] = __shfl_sync(0xffffffffu, row, d);
      src[d] = (d < R && rows[d] >= 0) ? reinterpret_cast<const int4*>(me + DEEP_EP_IC_CONTROL_BYTES + rows[d] * rb) : nullptr;
    }
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
      const float* wbase = reinterpret_cast<const float*>(me + s_woff);
      for (int j = lane; j < K; j += 32) {
        float w = 0.0f;
#pragma unroll
        for (int d = 0; d < kR; ++d) {
          if (src[d] != nullptr) w = __fadd_rn(w, __ldcg(wbase + rows[d] * K + j));
        }
        a.out_weights[n * K + j] = w;
      }
    }
  }
}

}  // namespace
}  // namespace ic
}  // namespace deep_ep

using namespace deep_ep;
using namespace deep_ep::ic;

extern "C" int deep_ep_ic_pull(const deep_ep_ic_ctx_t* ctx, const deep_ep_ic_pull_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_blocks < 1 || args->num_rows < 0 ||
      (args->num_rows > 0 && args->recv_x == nullptr) || args->num_local_experts < 0)
    return cudaErrorInvalidValue;
  pull_kernel<<<args->num_blocks, kThreads, 0, as_stream(stream)>>>(*ctx, *args);
  return cudaGetLastError();
}

extern "C" int deep_ep_ic_combine_push(const deep_ep_ic_ctx_t* ctx, const deep_ep_ic_push_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_blocks < 1 || args->num_rows < 0 || args->layout.row_bytes < 0 ||
      args->layout.num_topk < 0 || (args->num_rows > 0 && args->x == nullptr) || args->rank_prefix_matrix == nullptr)
    return cudaErrorInvalidValue;
  push_kernel<<<args->num_blocks, kThreads, 0, as_stream(stream)>>>(*ctx, *args);
  return cudaGetLastError();
}

extern "C" int deep_ep_ic_combine(const deep_ep_ic_ctx_t* ctx, const deep_ep_ic_combine_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_blocks < 1 || args->num_tokens < 0 || args->hidden < 0 ||
      args->hidden % 8 != 0 || args->num_channels < 1 || args->num_topk < 0 ||
      (args->num_tokens > 0 && (args->out == nullptr || args->rank_prefix_matrix == nullptr ||
                                args->channel_prefix_matrix == nullptr || args->is_token_in_rank == nullptr ||
                                args->send_head == nullptr)) ||
      (reinterpret_cast<uintptr_t>(args->out) & 15) != 0)
    return cudaErrorInvalidValue;
  const cudaStream_t s = as_stream(stream);
  if (ctx->num_ranks <= 2) combine_kernel<2><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  else if (ctx->num_ranks <= 4) combine_kernel<4><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  else combine_kernel<8><<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args);
  return cudaGetLastError();
}
