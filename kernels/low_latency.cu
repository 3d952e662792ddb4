// low_latency.cu: low-latency (LL) dispatch and combine over the NCCL window's peer pointers.
// Protocol, area layout and tags: deep_ep_kernels.h ("Low-latency mode"); the CPU backend
// (src/backend/cpu/ll.rs) defines the same results, bit for bit.
//
// Memory model: payload goes out with plain NVLink stores; every thread that stored fences at
// system scope, the block meets at __syncthreads, and one thread release-stores the signal word
// (st.release.sys). Receivers poll with ld.acquire.sys, meet at __syncthreads and read payload
// through L2 (__ldcg): the lines were never in this SM's L1 during the kernel.
//
// The only transport-specific lines are the peer addresses (`window(c, rank)`); an RDMA transport
// would replace the stores of push_* with puts and the signal store with a signalled put.
#include <cuda_fp8.h>

#include <cstdint>

#include "intranode.cuh"

namespace deep_ep {
namespace ic {
namespace {

// Send and dispatch-receive kernels: small blocks so that every block of a call is resident at
// once (a block per expert / (expert, rank) pair has only a few tokens); the combine receive
// reduces with large blocks.
constexpr int kLlThreads = 128;
constexpr int kLlWarps = kLlThreads / 32;
constexpr int kReduceThreads = 512;
// Scan tiles: kScanUnroll entries per thread in flight.
constexpr int kScanUnroll = 4;
constexpr int kScanTile = kScanUnroll * kLlThreads;
// Channels one warp moves per work item (8 FP8 scale groups, 2 KiB of BF16).
constexpr int kChunk = 1024;
// LL words of the control area's scratch (local only): the call counter and the "blocks done"
// counter of the send kernels (the last block advances the call counter and resets this one).
constexpr size_t kLlCalls = DEEP_EP_IC_CONTROL_BYTES - 1024;  // after the push-dispatch flags
constexpr size_t kLlDone = kLlCalls + 4;
static_assert(kScrEnd <= kLlCalls, "LL scratch overlaps the normal-mode scratch");
static_assert(kLlDone + 4 <= DEEP_EP_IC_CONTROL_BYTES, "LL scratch outside the control area");

using Args = deep_ep_ll_args_t;

__device__ __forceinline__ uint64_t sig_off(const Args& a, int h) { return a.ll_off + h * a.signal_bytes; }
__device__ __forceinline__ uint64_t send_off(const Args& a, int h) { return a.ll_off + 2 * a.signal_bytes + h * a.send_bytes; }
__device__ __forceinline__ uint64_t recv_off(const Args& a, int h) {
  return a.ll_off + 2 * (a.signal_bytes + a.send_bytes) + h * a.recv_bytes;
}

__device__ __forceinline__ void st_release_sys_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The call after `calls` (16 bits travel in a tag; 0 is skipped so a zeroed word never matches).
__device__ __forceinline__ uint32_t next_seq(uint32_t calls) {
  uint32_t s = calls + 1;
  if ((s & 0xffffu) == 0) s += 1;
  return s;
}
__device__ __forceinline__ uint32_t tag(uint32_t seq, uint32_t count) { return ((seq & 0xffffu) << 16) | (count + 1); }
__device__ __forceinline__ bool timed_out(const Ctx& c) { return ld_volatile(at<int>(local(c), kScrTimedOut)) != 0; }

__device__ __forceinline__ int64_t topk_at(const Args& a, int64_t j) {
  return a.topk_is_int64 ? static_cast<const int64_t*>(a.topk_idx)[j] : static_cast<const int32_t*>(a.topk_idx)[j];
}

// Start of a send kernel: the call number and the recv_state (block 0). Returns false when the
// buffer already timed out (nothing is sent; receivers then return at once too).
__device__ bool begin_send(const Ctx& c, const Args& a, int kind, uint32_t* s_seq, int* s_skip) {
  if (threadIdx.x == 0) {
    *s_skip = timed_out(c);
    *s_seq = next_seq(static_cast<uint32_t>(ld_volatile(at<int>(local(c), kLlCalls))));
    if (!*s_skip && blockIdx.x == 0 && blockIdx.y == 0) {
      a.recv_state[0] = a.half;
      a.recv_state[1] = *s_seq;
      a.recv_state[2] = a.flags;
      a.recv_state[3] = kind;
    }
  }
  __syncthreads();
  return !*s_skip;
}

// End of a send kernel: the last block to finish advances the call counter (every block read the
// old value before counting itself done).
__device__ void finish_send(const Ctx& c, uint32_t seq) {
  if (threadIdx.x == 0) {
    unsigned int* done = at<unsigned int>(local(c), kLlDone);
    __threadfence();
    if (atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1) {
      *at<volatile int>(local(c), kLlCalls) = static_cast<int>(seq);
      *at<volatile unsigned int>(local(c), kLlDone) = 0;
      __threadfence();
    }
  }
}

// Waits until `word` holds a tag of call `seq`; false (and a report) on timeout.
__device__ bool wait_tag(const Ctx& c, const uint32_t* word, uint32_t seq, int about_rank, int site, uint32_t* value) {
  const uint64_t start = globaltimer();
  while (true) {
    const uint32_t v = ld_acquire_sys_u32(word);
    if ((v >> 16) == (seq & 0xffffu) && (v & 0xffffu) != 0) {
      *value = v;
      return true;
    }
    if (globaltimer() - start > c.timeout_ns) {
      report(c, DEEP_EP_IC_ERR_TIMEOUT, about_rank, site, static_cast<int>(v), 0);
      return false;
    }
  }
}

// ---- FP8 (crate::numerics::fp8, DeepEP's calculate_fp8_scales) -------------------------------
__device__ __forceinline__ float pow2_bits(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }
__device__ __forceinline__ uint32_t e4m3(float v) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// One warp casts groups [g_begin, g_end) of token row `x` (H bf16) into `dst` (H E4M3 bytes then
// S f32 scale_inv). Lane i holds channels 4i..4i+3 of each 128-channel group; kGroups groups are
// loaded at once.
__device__ void cast_groups_fp8(const uint16_t* x, char* dst, int H, int g_begin, int g_end, bool round_scale, int lane) {
  constexpr int kGroups = kChunk / 128;
  const int S = g_end;
  for (int g0 = g_begin; g0 < S; g0 += kGroups) {
    uint2 v[kGroups];
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      if (g0 + u < S) v[u] = __ldg(reinterpret_cast<const uint2*>(x + (g0 + u) * 128 + lane * 4));
    }
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int g = g0 + u;
      if (g >= S) break;
      const float f[4] = {bf16_to_f32(v[u].x & 0xffffu), bf16_to_f32(v[u].x >> 16), bf16_to_f32(v[u].y & 0xffffu),
                          bf16_to_f32(v[u].y >> 16)};
      float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      amax = fmaxf(amax, 1e-4f);
      float scale, inv;
      if (round_scale) {
        const uint32_t b = __float_as_uint(amax * (1.0f / 448.0f));
        const int e = static_cast<int>((b >> 23) & 0xffu) - 127 + ((b & 0x7fffffu) != 0);
        scale = pow2_bits(-e);
        inv = pow2_bits(e);
      } else {
        scale = __fdiv_rn(448.0f, amax);
        inv = amax * (1.0f / 448.0f);
      }
      const uint32_t q = e4m3(f[0] * scale) | (e4m3(f[1] * scale) << 8) | (e4m3(f[2] * scale) << 16) | (e4m3(f[3] * scale) << 24);
      *reinterpret_cast<uint32_t*>(dst + g * 128 + lane * 4) = q;
      if (lane == 0) *reinterpret_cast<float*>(dst + H + g * 4) = inv;
    }
  }
}

// ---- dispatch ---------------------------------------------------------------------------------
// Block e (global expert): scans topk_idx in tiles of kScanTile entries (ballot + prefix over
// (unroll step, warp), so slots follow (token, k) order), and per tile its warps push the
// selecting tokens, one (token, kChunk channels) work item at a time.
__global__ void __launch_bounds__(kLlThreads) ll_dispatch_send_kernel(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  __shared__ uint32_t s_seq;
  __shared__ int s_skip;
  __shared__ int s_warp[kScanUnroll * kLlWarps];
  __shared__ int s_tok[kScanTile];
  if (!begin_send(c, a, DEEP_EP_LL_KIND_DISPATCH, &s_seq, &s_skip)) return;
  const int e = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, El = a.num_experts / R, dst = e / El, l = e % El, T = a.num_max_tokens, H = a.hidden;
  const int64_t total = static_cast<int64_t>(a.num_tokens) * a.num_topk;
  const int nchunks = (H + kChunk - 1) / kChunk;
  char* peer = window(c, dst);
  const uint64_t msg_base = recv_off(a, a.half) + static_cast<uint64_t>(l * R + c.rank) * T * a.msg_bytes;
  int base = 0;
  for (int64_t t0 = 0; t0 < total; t0 += kScanTile) {
    bool m[kScanUnroll];
#pragma unroll
    for (int u = 0; u < kScanUnroll; ++u) {
      const int64_t j = t0 + u * kLlThreads + tid;
      m[u] = j < total && topk_at(a, j) == e;
    }
    unsigned b[kScanUnroll];
#pragma unroll
    for (int u = 0; u < kScanUnroll; ++u) {
      b[u] = __ballot_sync(0xffffffffu, m[u]);
      if (lane == 0) s_warp[u * kLlWarps + warp] = __popc(b[u]);
    }
    __syncthreads();
    int tile = 0;
#pragma unroll
    for (int q = 0; q < kScanUnroll * kLlWarps; ++q) tile += s_warp[q];
#pragma unroll
    for (int u = 0; u < kScanUnroll; ++u) {
      if (!m[u]) continue;
      int before = 0;
      for (int q = 0; q < u * kLlWarps + warp; ++q) before += s_warp[q];
      const int64_t j = t0 + u * kLlThreads + tid;
      s_tok[before + __popc(b[u] & ((1u << lane) - 1))] = static_cast<int>(j / a.num_topk);
    }
    __syncthreads();
    for (int it = warp; it < tile * nchunks; it += kLlWarps) {
      const int i = it / nchunks, ch = it % nchunks;
      const int slot = base + i;
      if (slot >= T) break;
      const int tok = s_tok[i];
      char* msg = peer + msg_base + static_cast<uint64_t>(slot) * a.msg_bytes;
      if (ch == 0 && lane == 0) *reinterpret_cast<int4*>(msg) = make_int4(tok, H, T, a.num_experts);
      const uint16_t* row = static_cast<const uint16_t*>(a.x) + static_cast<int64_t>(tok) * H;
      const int c0 = ch * kChunk, c1 = min(H, c0 + kChunk);
      if (a.use_fp8) {
        cast_groups_fp8(row, msg + 16, H, c0 / 128, c1 / 128, a.round_scale != 0, lane);
      } else {
        warp_copy(msg + 16 + 2 * static_cast<int64_t>(c0), row + c0, 2 * static_cast<int64_t>(c1 - c0), lane);
      }
    }
    base += tile;
    __syncthreads();  // s_warp and s_tok are rewritten by the next tile
  }
  __threadfence_system();
  __syncthreads();
  if (tid == 0) {
    if (base > T) report(c, DEEP_EP_IC_ERR_OVERFLOW, dst, DEEP_EP_IC_SITE_LL_DISPATCH, base, T);
    uint32_t* word = at<uint32_t>(peer, sig_off(a, a.half) + static_cast<uint64_t>(l * R + c.rank) * 4);
    st_release_sys_u32(word, tag(s_seq, static_cast<uint32_t>(min(base, T))));
  }
  finish_send(c, s_seq);
}

// Reads recv_state: false (after reporting) when it does not come from a send of `kind` with
// `flags`, or the buffer timed out.
__device__ bool read_state(const Ctx& c, const Args& a, int kind, bool check_flags, int site, int* half, uint32_t* seq) {
  if (timed_out(c)) return false;
  const int64_t* st = a.recv_state;
  if (st[3] != kind || (check_flags && st[2] != a.flags) || st[0] < 0 || st[0] > 1) {
    report(c, DEEP_EP_IC_ERR_MISMATCH, c.rank, site, static_cast<int>(st[3]), kind);
    return false;
  }
  *half = static_cast<int>(st[0]);
  *seq = static_cast<uint32_t>(st[1]);
  return true;
}

// Block (l, y): waits for the R counts of local expert l, then warps y*16+w, stepping by
// gridDim.y*16, copy the rows (sources ascending, then slot order).
__global__ void __launch_bounds__(kLlThreads) ll_dispatch_recv_kernel(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  __shared__ int s_ok, s_half;
  __shared__ uint32_t s_seq;
  __shared__ int s_cnt[kMaxRanks], s_begin[kMaxRanks + 1];
  const int l = blockIdx.x, y = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, T = a.num_max_tokens, H = a.hidden, S = H / 128;
  const int64_t RT = static_cast<int64_t>(R) * T;
  if (tid == 0) {
    int h = 0;
    uint32_t q = 0;
    s_ok = read_state(c, a, DEEP_EP_LL_KIND_DISPATCH, true, DEEP_EP_IC_SITE_LL_DISPATCH, &h, &q);
    s_half = h;
    s_seq = q;
  }
  __syncthreads();
  if (!s_ok) return;
  char* me = local(c);
  if (tid < R) {
    const long long t0 = clock64();
    uint32_t v = 0;
    const uint32_t* word = at<const uint32_t>(me, sig_off(a, s_half) + static_cast<uint64_t>(l * R + tid) * 4);
    if (wait_tag(c, word, s_seq, tid, DEEP_EP_IC_SITE_LL_DISPATCH, &v)) {
      s_cnt[tid] = min(static_cast<int>(v & 0xffffu) - 1, T);
      if (y == 0 && a.wait_stats != nullptr) {
        atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + tid), static_cast<unsigned long long>(clock64() - t0));
      }
    } else {
      s_ok = 0;
    }
  }
  __syncthreads();
  if (!s_ok) return;
  if (tid == 0) {
    s_begin[0] = 0;
    for (int s = 0; s < R; ++s) s_begin[s + 1] = s_begin[s] + s_cnt[s];
  }
  __syncthreads();
  const int total = s_begin[R];
  if (y == 0) {
    if (tid < R) a.layout_range[l * R + tid] = (static_cast<int64_t>(s_begin[tid]) << 32) | s_cnt[tid];
    if (tid == 0) {
      a.recv_count[l] = total;
      if (a.cumulative != nullptr) a.cumulative[l] += total;
    }
  }
  const uint64_t recv = recv_off(a, s_half);
  const int64_t xrow_bytes = a.use_fp8 ? H : 2 * static_cast<int64_t>(H);
  for (int i = y * kLlWarps + warp; i < total; i += gridDim.y * kLlWarps) {
    int s = 0;
    while (s + 1 < R && i >= s_begin[s + 1]) ++s;
    const int slot = i - s_begin[s];
    const char* msg = me + recv + (static_cast<uint64_t>(l * R + s) * T + slot) * a.msg_bytes;
    const int4 hdr = __ldcg(reinterpret_cast<const int4*>(msg));
    if (hdr.y != H || hdr.z != T || hdr.w != a.num_experts) {
      if (lane == 0) report(c, DEEP_EP_IC_ERR_MISMATCH, s, DEEP_EP_IC_SITE_LL_DISPATCH, hdr.y, H);
      continue;
    }
    const int64_t row = l * RT + i;
    if (lane == 0) a.src_info[row] = hdr.x;
    warp_copy(static_cast<char*>(a.recv_x) + row * xrow_bytes, msg + 16, xrow_bytes, lane);
    if (!a.use_fp8) continue;
    const float* si = reinterpret_cast<const float*>(msg + 16 + H);
    const int64_t sbase = l * a.scale_stride[0] + i * a.scale_stride[1];
    if (a.use_ue8m0) {
      for (int p = lane; p < S / 4; p += 32) {
        uint32_t pack = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) pack |= ((__float_as_uint(__ldcg(si + 4 * p + b)) >> 23) & 0xffu) << (8 * b);
        static_cast<int32_t*>(a.recv_scales)[sbase + p * a.scale_stride[2]] = static_cast<int32_t>(pack);
      }
    } else {
      for (int g = lane; g < S; g += 32) static_cast<float*>(a.recv_scales)[sbase + g * a.scale_stride[2]] = __ldcg(si + g);
    }
  }
}

// ---- combine ----------------------------------------------------------------------------------
// Block (l, s): pushes rows layout_range[l][s] of local expert l back to source rank s, keyed by
// (global expert, source token), then signals word s_global = rank*E_l + l on rank s.
__global__ void __launch_bounds__(kLlThreads) ll_combine_send_kernel(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  __shared__ uint32_t s_seq;
  __shared__ int s_skip;
  if (!begin_send(c, a, DEEP_EP_LL_KIND_COMBINE, &s_seq, &s_skip)) return;
  const int l = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, El = a.num_experts / R, T = a.num_max_tokens, H = a.hidden;
  const int64_t RT = static_cast<int64_t>(R) * T, M = H + H / 128 * 2;
  const int64_t lr = a.layout_range[l * R + s];
  const int64_t b = lr >> 32;
  int64_t cnt = lr & 0xffffffffLL;
  if (b < 0 || cnt > T || b + cnt > RT) cnt = 0;  // not from a dispatch of this geometry (the host checks shapes)
  char* peer = window(c, s);
  const uint64_t dst_base = recv_off(a, a.half) + static_cast<uint64_t>(c.rank * El + l) * T * (2 * static_cast<uint64_t>(H));
  const int nchunks = (H + kChunk - 1) / kChunk;
  for (int64_t it = warp; it < cnt * nchunks; it += kLlWarps) {
    const int64_t row = b + it / nchunks;
    const int c0 = static_cast<int>(it % nchunks) * kChunk, c1 = min(H, c0 + kChunk);
    const int tok = a.src_info[l * RT + row];
    if (tok < 0 || tok >= T) continue;
    const uint16_t* src = a.zero_copy ? reinterpret_cast<const uint16_t*>(local(c) + send_off(a, a.half) + (l * RT + row) * M * 2)
                                      : static_cast<const uint16_t*>(a.x) + (l * RT + row) * H;
    warp_copy(peer + dst_base + (static_cast<uint64_t>(tok) * H + c0) * 2, src + c0, 2 * static_cast<int64_t>(c1 - c0), lane);
  }
  __threadfence_system();
  __syncthreads();
  if (tid == 0) {
    uint32_t* word = at<uint32_t>(peer, sig_off(a, a.half) + static_cast<uint64_t>(c.rank * El + l) * 4);
    st_release_sys_u32(word, tag(s_seq, 0));
  }
  finish_send(c, s_seq);
}

// Every block waits for all E words, then reduces tokens blockIdx.x, +gridDim.x, ...: thread j
// owns channels 8j..8j+7: acc = fma(y_k, w_k, acc) over k in order (crate: f32::mul_add).
__global__ void __launch_bounds__(kReduceThreads) ll_combine_recv_kernel(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  __shared__ int s_ok, s_half;
  __shared__ uint32_t s_seq;
  __shared__ unsigned long long s_wait[kMaxRanks];
  __shared__ int64_t s_e[16];
  __shared__ float s_w[16];
  const int tid = threadIdx.x, R = c.num_ranks, El = a.num_experts / R, E = a.num_experts, T = a.num_max_tokens, H = a.hidden;
  const int K = a.num_topk;
  if (tid == 0) {
    int h = 0;
    uint32_t q = 0;
    s_ok = read_state(c, a, DEEP_EP_LL_KIND_COMBINE, false, DEEP_EP_IC_SITE_LL_COMBINE, &h, &q);
    s_half = h;
    s_seq = q;
  }
  if (tid < kMaxRanks) s_wait[tid] = 0;
  __syncthreads();
  if (!s_ok) return;
  char* me = local(c);
  for (int w = tid; w < E; w += blockDim.x) {
    const long long t0 = clock64();
    uint32_t v = 0;
    if (!wait_tag(c, at<const uint32_t>(me, sig_off(a, s_half) + static_cast<uint64_t>(w) * 4), s_seq, w / El,
                  DEEP_EP_IC_SITE_LL_COMBINE, &v)) {
      s_ok = 0;
      break;
    }
    atomicMax(&s_wait[w / El], static_cast<unsigned long long>(clock64() - t0));
  }
  __syncthreads();
  if (!s_ok) return;
  if (blockIdx.x == 0 && tid < R && a.wait_stats != nullptr) {
    atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + tid), s_wait[tid]);
  }
  const char* recv = me + recv_off(a, s_half);
  const uint64_t row_bytes = 2 * static_cast<uint64_t>(H);
  for (int tok = blockIdx.x; tok < a.num_tokens; tok += gridDim.x) {
    if (tid < K) {
      s_e[tid] = topk_at(a, static_cast<int64_t>(tok) * K + tid);
      s_w[tid] = a.topk_weights[static_cast<int64_t>(tok) * K + tid];
    }
    __syncthreads();
    for (int j = tid; j < H / 8; j += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
      for (int k = 0; k < K; ++k) {
        const int64_t e = s_e[k];
        if (e < 0 || e >= E) continue;
        const int4 v = __ldcg(reinterpret_cast<const int4*>(recv + (static_cast<uint64_t>(e) * T + tok) * row_bytes) + j);
        const uint32_t wv[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
        const float wt = s_w[k];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          acc[2 * u] = __fmaf_rn(bf16_to_f32(wv[u] & 0xffffu), wt, acc[2 * u]);
          acc[2 * u + 1] = __fmaf_rn(bf16_to_f32(wv[u] >> 16), wt, acc[2 * u + 1]);
        }
      }
      int4 o;
      o.x = static_cast<int>(bf16_bits(acc[0]) | (static_cast<uint32_t>(bf16_bits(acc[1])) << 16));
      o.y = static_cast<int>(bf16_bits(acc[2]) | (static_cast<uint32_t>(bf16_bits(acc[3])) << 16));
      o.z = static_cast<int>(bf16_bits(acc[4]) | (static_cast<uint32_t>(bf16_bits(acc[5])) << 16));
      o.w = static_cast<int>(bf16_bits(acc[6]) | (static_cast<uint32_t>(bf16_bits(acc[7])) << 16));
      reinterpret_cast<int4*>(a.out + static_cast<int64_t>(tok) * H)[j] = o;
    }
    __syncthreads();  // s_e / s_w are rewritten for the next token
  }
}

__global__ void ll_zero_signals_kernel(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  uint32_t* w = at<uint32_t>(local(c), a.ll_off);
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < a.signal_bytes / 2; i += gridDim.x * blockDim.x) w[i] = 0;
}

bool ll_ok(const Ctx* c, const Args* a) {
  if (!ctx_ok(c) || a == nullptr) return false;
  if (a->num_max_tokens < 1 || a->num_max_tokens > 0xfffe || a->hidden < 128 || a->hidden % 128 != 0) return false;
  if (a->num_experts < c->num_ranks || a->num_experts % c->num_ranks != 0 || a->half < 0 || a->half > 1) return false;
  if (a->num_topk < 0 || a->num_topk > 16 || a->num_tokens < 0 || a->num_tokens > a->num_max_tokens) return false;
  const uint64_t end = a->ll_off + 2 * (a->signal_bytes + a->send_bytes + a->recv_bytes);
  return a->ll_off % 128 == 0 && a->msg_bytes % 16 == 0 && a->signal_bytes % 16 == 0 && a->send_bytes % 16 == 0 &&
         a->recv_bytes % 16 == 0 && end <= c->window_bytes && a->signal_bytes * 8 >= 4ull * 8 * a->num_experts;
}

}  // namespace
}  // namespace ic
}  // namespace deep_ep

using namespace deep_ep::ic;

extern "C" int deep_ep_llk_dispatch_send(const deep_ep_ic_ctx_t* ctx, const deep_ep_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args) || args->recv_state == nullptr || (args->num_tokens > 0 && (args->x == nullptr || args->topk_idx == nullptr)))
    return static_cast<int>(cudaErrorInvalidValue);
  ll_dispatch_send_kernel<<<args->num_experts, kLlThreads, 0, deep_ep::as_stream(stream)>>>(*ctx, *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int deep_ep_llk_dispatch_recv(const deep_ep_ic_ctx_t* ctx, const deep_ep_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args) || args->recv_state == nullptr || args->recv_x == nullptr || args->recv_count == nullptr ||
      args->src_info == nullptr || args->layout_range == nullptr || (args->use_fp8 && args->recv_scales == nullptr))
    return static_cast<int>(cudaErrorInvalidValue);
  const int el = args->num_experts / ctx->num_ranks;
  const int y = args->num_blocks > el ? (args->num_blocks + el - 1) / el : 1;
  ll_dispatch_recv_kernel<<<dim3(el, y), kLlThreads, 0, deep_ep::as_stream(stream)>>>(*ctx, *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int deep_ep_llk_combine_send(const deep_ep_ic_ctx_t* ctx, const deep_ep_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args) || args->recv_state == nullptr || args->src_info == nullptr || args->layout_range == nullptr ||
      (!args->zero_copy && args->x == nullptr))
    return static_cast<int>(cudaErrorInvalidValue);
  const int el = args->num_experts / ctx->num_ranks;
  ll_combine_send_kernel<<<dim3(el, ctx->num_ranks), kLlThreads, 0, deep_ep::as_stream(stream)>>>(*ctx, *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int deep_ep_llk_combine_recv(const deep_ep_ic_ctx_t* ctx, const deep_ep_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args) || args->recv_state == nullptr || (args->num_tokens > 0 && (args->out == nullptr || args->topk_idx == nullptr ||
                                                                                  args->topk_weights == nullptr)))
    return static_cast<int>(cudaErrorInvalidValue);
  // With no token the receive still waits for every word (the call completes for every rank).
  const int blocks = args->num_tokens < 1 ? 1 : (args->num_tokens < args->num_blocks ? args->num_tokens : args->num_blocks);
  ll_combine_recv_kernel<<<blocks, kReduceThreads, 0, deep_ep::as_stream(stream)>>>(*ctx, *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int deep_ep_llk_zero_signals(const deep_ep_ic_ctx_t* ctx, const deep_ep_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args)) return static_cast<int>(cudaErrorInvalidValue);
  ll_zero_signals_kernel<<<16, 256, 0, deep_ep::as_stream(stream)>>>(*ctx, *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" size_t deep_ep_llk_args_bytes(void) { return sizeof(deep_ep_ll_args_t); }
