// ll_combine_local.cuh: what the combine's sums share, and the one-rank combine built from them.
// partial_units sums rows of y (the partial send's rows, and the one-rank combine's); check_routing
// compares a combine's topk_idx / topk_weights with its dispatch's. combine_local (one rank, one
// launch) reduces straight from y: at one rank the peer path copies every selected row into its
// own receive area and reads it back (twice the bytes, a grid-wide wait between; bench/LL_PROFILE.md
// 11.4 item 10, bench/NOTES.md session 25); combine_local_logfmt is its LogFMT form (session 52).
#pragma once

#include <cstdint>

#include "logfmt.cuh"
#include "low_latency.cuh"

namespace deep_ep {
namespace ll {
namespace {

// Thread tid's channel units [u_lo, u_hi) of a partial-sum row: out = bf16(sum over the n rows
// in order of fma(y, w, acc)). kJ units x kQ rows are loaded before any is summed: the send is
// bound by loads in flight, not by bytes (one 16-byte load per thread in flight took ~3x the wire
// time). Every unit's sum runs in the same order whatever kQ and kJ: the result is bit-exact.
// row[q]: the q-th entry's row (a zero-copy slot of M bf16, or a row of x; 16-byte aligned), < 0:
// skipped; w[q] its weight.
template <int kQ, int kJ>
__device__ __forceinline__ void partial_units(const Ctx& c, const Args& a, int u_lo, int u_hi, int n, const int64_t* row, const float* w,
                                              char* out_row) {
  const int64_t M = a.hidden + a.hidden / 128 * 2;
  for (int j0 = u_lo + static_cast<int>(threadIdx.x); j0 < u_hi; j0 += kJ * kLlThreads) {
    float acc[kJ][8];
#pragma unroll
    for (int i = 0; i < kJ; ++i) {
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[i][u] = 0.0f;
    }
    for (int q0 = 0; q0 < n; q0 += kQ) {
      uint32_t wv[kQ][kJ][4];
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        const int64_t r = q0 + q < n ? row[q0 + q] : -1;
        const int4* y = reinterpret_cast<const int4*>(a.zero_copy ? local(c) + send_off(a, a.half) + r * M * 2
                                                                  : reinterpret_cast<const char*>(static_cast<const uint16_t*>(a.x) + r * a.hidden));
#pragma unroll
        for (int i = 0; i < kJ; ++i) {
          const int j = j0 + i * kLlThreads;
          int4 v = make_int4(0, 0, 0, 0);
          if (r >= 0 && j < u_hi) v = __ldcg(y + j);
          wv[q][i][0] = static_cast<uint32_t>(v.x), wv[q][i][1] = static_cast<uint32_t>(v.y);
          wv[q][i][2] = static_cast<uint32_t>(v.z), wv[q][i][3] = static_cast<uint32_t>(v.w);
        }
      }
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        if (q0 + q >= n || row[q0 + q] < 0) continue;
#pragma unroll
        for (int i = 0; i < kJ; ++i) fma_bf16x8(acc[i], wv[q][i], w[q0 + q]);
      }
    }
#pragma unroll
    for (int i = 0; i < kJ; ++i) {
      const int j = j0 + i * kLlThreads;
      if (j < u_hi) reinterpret_cast<int4*>(out_row)[j] = pack_bf16x8(acc[i]);
    }
  }
}

// One block of a combine receive: the fingerprint of its topk_idx (and, when the combine sent
// partial sums, of its topk_weights) against the dispatch's the combine answers: routing words
// id_word and w_word (kLlRouting; 0 = unknown, w_word < 0: no weights). Others would silently sum
// the wrong rows or weights: reported (DEK_IC_ERR_LL_ROUTING, raised at the next call), as the CPU
// backend raises at once. s_fp, s_fpw: kReduceThreads / 32 words each of the caller's kernel-scope
// shared memory (the per-warp shares; a function-scope array here was one symbol across every
// combine kernel, which the device link placed past all of their variables: CombineRecvShared).
__device__ void check_routing_at(const Ctx& c, const Args& a, int id_word, int w_word, unsigned long long* s_fp, unsigned long long* s_fpw) {
  const uint64_t want = ld_volatile(at<uint64_t>(local(c), kLlRouting) + id_word);
  const uint64_t want_w = w_word < 0 ? 0 : ld_volatile(at<uint64_t>(local(c), kLlRouting) + w_word);
  if (want == 0) return;  // the same word for every thread: the branch is uniform
  const int64_t nk = static_cast<int64_t>(a.num_tokens) * a.num_topk;
  uint64_t h = 0, hw = 0;
  for (int64_t j = threadIdx.x; j < nk; j += blockDim.x) {
    h += routing_mix(j, topk_at(a, j));
    if (want_w != 0) hw += routing_mix(j, __float_as_uint(a.topk_weights[j]));
  }
  warp_shares_u64(h, hw, s_fp, s_fpw);
  __syncthreads();
  if (threadIdx.x != 0) return;
  h = shares_sum_u64(s_fp, blockDim.x / 32);
  hw = shares_sum_u64(s_fpw, blockDim.x / 32);
  if (routing_seal(h, a.num_tokens, a.num_topk) != want) {
    report(c, DEK_IC_ERR_LL_ROUTING, c.rank, DEK_IC_SITE_LL_COMBINE, a.num_tokens, a.num_topk, 0);
  } else if (want_w != 0 && routing_seal(hw, a.num_tokens, a.num_topk) != want_w) {
    report(c, DEK_IC_ERR_LL_ROUTING, c.rank, DEK_IC_SITE_LL_COMBINE, a.num_tokens, a.num_topk, 1);
  }
}

// A two-launch combine receive's routing check: the copies its send kernel made (kLlRouting
// [2 + half], [6 + half]).
__device__ __forceinline__ void check_routing(const Ctx& c, const Args& a, int half, unsigned long long* fp, unsigned long long* fpw) {
  check_routing_at(c, a, 2 + half, 6 + half, fp, fpw);
}
// A one-launch combine's: the dispatch's words themselves (block 0 copies them in the same kernel,
// with nothing ordering that store before another block's check).
__device__ __forceinline__ void check_routing_direct(const Ctx& c, const Args& a, unsigned long long* fp, unsigned long long* fpw) {
  if (a.routing_half == 0 || a.routing_half == 1) check_routing_at(c, a, a.routing_half, a.partial ? 4 + a.routing_half : -1, fp, fpw);
}

// The row of y (l * R*T + row) holding token tok's selection of local expert l at one rank, or -1:
// a binary search of the expert's src_info rows, which a dispatch at one rank writes in token order
// (slot order = (token, k) order); rows not in order (not from such a dispatch) are scanned.
// layout_range as the peer send reads it: a range no dispatch of this geometry makes has no rows.
__device__ __forceinline__ int64_t local_row(const Args& a, int l, int tok, int64_t RT) {
  const int64_t lr = __ldg(a.layout_range + l), b = lr >> 32, cnt = lr & 0xffffffffLL;
  if (b < 0 || cnt > a.num_max_tokens || b + cnt > RT) return -1;
  const int* si = a.src_info + l * RT + b;
  int64_t lo = 0, hi = cnt;  // the first row whose token is >= tok
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (__ldg(si + mid) < tok) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo < cnt && __ldg(si + lo) == tok) return l * RT + b + lo;
  for (int64_t i = 0; i < cnt; ++i) {
    if (__ldg(si + i) == tok) return l * RT + b + i;
  }
  return -1;
}

// The one-launch combine at one rank (no hook, overlap, LogFMT or seam; rows or partial sums): work
// item w of the grid is slice w % P of token w / P (P blocks share a token when there are more
// blocks than tokens); warp 0's lane k finds selection k's row of y (local_row; -1 for no expert,
// or the rank masked), then the block sums the rows in k order (partial_units: fma in f32, one BF16
// rounding: the bits of the peer path's rows receive and of its one-rank partial sum, 0 +
// bf16(acc)). Kept from the peer path: begin_send (a timed-out buffer skips, the call number, the
// routing fingerprints the combine answers), the routing check (by the last block), the call
// counter (block 0). No signal, format word or receive area is touched.
template <class Net>
__device__ __forceinline__ void combine_local(const Ctx& c, const Args& a) {
  __shared__ uint32_t s_seq;
  __shared__ int s_skip;
  __shared__ int64_t s_row[kMaxLlTopk];
  __shared__ float s_w[kMaxLlTopk];
  __shared__ unsigned long long s_fp[kReduceThreads / 32], s_fpw[kReduceThreads / 32];  // check_routing_at's shares (one kernel inlines this)
  if (!begin_send(c, a, DEK_LL_KIND_COMBINE, &s_seq, &s_skip)) return;
  // The grid's last block checks the routing: the items end before it when N * P < the grid, so the
  // check (two passes over N * K entries with weights) is off the critical path.
  if (blockIdx.x == gridDim.x - 1) check_routing_direct(c, a, s_fp, s_fpw);
  const int tid = threadIdx.x, K = a.num_topk, E = a.num_experts, H = a.hidden, N = a.num_tokens;
  const int64_t RT = a.num_max_tokens, M = H + H / 128 * 2;
  const bool dead = rank_masked(a, 0);
  const int U = H / 8, blocks = static_cast<int>(gridDim.x);
  const int P = N < 1 ? 1 : max(1, min(blocks / N, (U + kLlThreads - 1) / kLlThreads));
  // Rows of zero-copy buffers are M bf16 long: 16-byte loads only when M*2 is a multiple of 16.
  const bool vec = !a.zero_copy || (M * 2) % 16 == 0;
  for (int item = blockIdx.x; item < N * P; item += blocks) {
    const int tok = item / P, u_lo = (item % P) * U / P, u_hi = (item % P + 1) * U / P;
    if (tid < K) {
      const int64_t j = static_cast<int64_t>(tok) * K + tid, e = topk_at(a, j);
      s_row[tid] = e >= 0 && e < E && !dead ? local_row(a, static_cast<int>(e), tok, RT) : -1;
      s_w[tid] = a.topk_weights[j];
    }
    __syncthreads();
    char* out_row = reinterpret_cast<char*>(a.out + static_cast<int64_t>(tok) * H);
    if (!vec) {
      for (int j = u_lo + tid; j < u_hi; j += kLlThreads) {
        float acc[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
        for (int q = 0; q < K; ++q) {
          if (s_row[q] < 0) continue;
          const unsigned int* y = reinterpret_cast<const unsigned int*>(local(c) + send_off(a, a.half) + s_row[q] * M * 2);
          uint32_t wv[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) wv[u] = __ldcg(y + 4 * j + u);
          fma_bf16x8(acc, wv, s_w[q]);
        }
        reinterpret_cast<int4*>(out_row)[j] = pack_bf16x8(acc);
      }
    } else if (K <= 2) {
      partial_units<2, 4>(c, a, u_lo, u_hi, K, s_row, s_w, out_row);
    } else if (K <= 4) {
      partial_units<4, 2>(c, a, u_lo, u_hi, K, s_row, s_w, out_row);
    } else {
      partial_units<8, 1>(c, a, u_lo, u_hi, K, s_row, s_w, out_row);
    }
    __syncthreads();  // s_row / s_w are rewritten for the next item
  }
  // The call counter, by block 0 with no ticket (as the one-rank dispatch: nothing of the local
  // form reads s_seq, so a block that reads the counter after this store is harmless).
  if (blockIdx.x == 0 && tid == 0) *at<volatile int>(local(c), kLlCalls) = static_cast<int>(s_seq);
}

// The one-rank LogFMT combine (combine_local_logfmt): blocks of 8 warps, a chunk's groups at most,
// 4 per SM (64 registers: 32 warps per SM to hide its loads' and reductions' latency).
constexpr int kLfLocalThreads = 32 * logfmt::kChunkGroups;
constexpr int kLfLocalBlocksPerSm = 4;
// Selections whose loads a thread of the sum has in flight at once.
constexpr int kLfLocalBatch = 8;
// A cast group's parameters for the sum (phase B): the encoder constants and the decoder's.
struct LfLocalParam {
  int64_t c;
  uint32_t m;
  int32_t step, base;
};

// The one-launch combine at one rank with LogFMT: combine_local's sums, each expert row
// LogFMT-encoded and decoded on the way (logfmt.cuh: encode_value then decode_value, the bits the
// receive of the peer path decodes from what its send encoded), with no receive area between. At one
// rank the peer path encodes every row into its own receive area, waits for the grid, and reads it
// back (bench/NOTES.md session 52). Work item w of the grid is chunk w % C of token w / C (C chunks
// of logfmt::chunk_channels a row, the cast decision's unit):
// - phase A, warp k per selection k: its row of y (local_row, as combine_local), the chunk's group
//   amax / amin (warp reductions), lane g's group g parameters and the chunk's cast vote (as the
//   send's encode_chunk_warp), into shared memory;
// - phase B, warp g per group g: lane l's channels 4l..4l+3, fma(value, w_k, acc) over k in order
//   (the peer receive's order and rounding: bit for bit), one BF16 rounding; a cast value is
//   roundtrip_value (decode_value of encode_value without the 10-bit value between).
// Phase B reads the rows phase A read on this SM (`__ldg`: through L1). Kept from combine_local:
// begin_send, the routing check (by the last block), the call counter (block 0).
template <class Net>
__device__ __forceinline__ void combine_local_logfmt(const Ctx& c, const Args& a) {
  __shared__ uint32_t s_seq;
  __shared__ int s_skip;
  __shared__ logfmt::Log2Table s_tab;
  __shared__ int64_t s_row[kMaxLlTopk];
  __shared__ float s_w[kMaxLlTopk];
  __shared__ int s_cast[kMaxLlTopk];
  __shared__ LfLocalParam s_par[kMaxLlTopk][logfmt::kChunkGroups];
  __shared__ unsigned long long s_fp[kReduceThreads / 32], s_fpw[kReduceThreads / 32];  // check_routing_at's shares
  if (!begin_send(c, a, DEK_LL_KIND_COMBINE, &s_seq, &s_skip)) return;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, nw = static_cast<int>(blockDim.x / 32);
  for (int i = tid; i < logfmt::kLog2Entries; i += blockDim.x) logfmt::fill_log2_entry(s_tab, i);  // read after the first barrier
  if (blockIdx.x == gridDim.x - 1) check_routing_direct(c, a, s_fp, s_fpw);
  const int K = a.num_topk, E = a.num_experts, H = a.hidden, N = a.num_tokens;
  const int64_t RT = a.num_max_tokens;
  const bool dead = rank_masked(a, 0);
  const int chunk = logfmt::chunk_channels(H), C = (H + chunk - 1) / chunk;
  const uint16_t* const y = static_cast<const uint16_t*>(a.x);
  for (int item = blockIdx.x; item < N * C; item += static_cast<int>(gridDim.x)) {
    const int tok = item / C, c0 = (item % C) * chunk, ng = min(chunk, H - c0) / logfmt::kGroup;
    for (int k = warp; k < K; k += nw) {  // phase A
      int64_t row = -1;
      if (lane == 0) {
        const int64_t j = static_cast<int64_t>(tok) * K + k, e = topk_at(a, j);
        row = e >= 0 && e < E && !dead ? local_row(a, static_cast<int>(e), tok, RT) : -1;
        s_row[k] = row;
        s_w[k] = a.topk_weights[j];
      }
      row = __shfl_sync(0xffffffffu, row, 0);
      if (row < 0) continue;
      const uint2* src = reinterpret_cast<const uint2*>(y + row * H + c0) + lane;
      uint2 v[logfmt::kChunkGroups];
#pragma unroll
      for (int g = 0; g < logfmt::kChunkGroups; ++g) v[g] = g < ng ? __ldg(src + g * (logfmt::kGroup / 4)) : make_uint2(0, 0);
      // Lane g: group g's amax / amin bits. Every group reduced, past ng too (their results unused):
      // no warp-wide reduction under a branch (each was a divergence check).
      uint32_t my_max = 0, my_min = 0;
#pragma unroll
      for (int g = 0; g < logfmt::kChunkGroups; ++g) {
        const uint32_t m0 = v[g].x & 0x7fff7fffu, m1 = v[g].y & 0x7fff7fffu;  // magnitudes, two per word
        const uint32_t hi = __vmaxu2(m0, m1), lo = __vminu2(m0, m1);
        const uint32_t mx = __reduce_max_sync(0xffffffffu, max(hi & 0xffffu, hi >> 16));
        const uint32_t mn = __reduce_min_sync(0xffffffffu, min(lo & 0xffffu, lo >> 16));
        my_max = lane == g ? mx : my_max;
        my_min = lane == g ? mn : my_min;
      }
      const logfmt::Group mine = logfmt::group_params_t(s_tab.tq, my_max, my_min);
      const bool cast = __all_sync(0xffffffffu, lane >= ng || mine.castable);
      if (lane == 0) s_cast[k] = cast;
      if (cast && lane < ng) {
        const logfmt::Encoder en = logfmt::encoder(mine);
        s_par[k][lane] = LfLocalParam{en.c, en.m, mine.step_q, logfmt::decode_base(mine)};
      }
    }
    __syncthreads();  // (the first item's: the table too)
    if (warp < ng) {  // phase B: group `warp` of the chunk
      const uint2* src = reinterpret_cast<const uint2*>(y + c0 + warp * logfmt::kGroup) + lane;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int k0 = 0; k0 < K; k0 += kLfLocalBatch) {
        uint2 v[kLfLocalBatch];
#pragma unroll
        for (int u = 0; u < kLfLocalBatch; ++u) {
          const int64_t row = k0 + u < K ? s_row[k0 + u] : -1;
          if (row >= 0) v[u] = __ldg(src + row * (H / 4));
        }
#pragma unroll
        for (int u = 0; u < kLfLocalBatch; ++u) {  // in order k = k0, k0 + 1, ...
          const int k = k0 + u;
          if (k >= K || s_row[k] < 0) continue;
          const uint32_t w2[2] = {v[u].x, v[u].y};
          if (s_cast[k]) {
            const LfLocalParam p = s_par[k][warp];
            const logfmt::Encoder en{p.m, p.c};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const uint32_t b = w2[i / 2] >> (16 * (i % 2)) & 0xffffu;
              acc[i] = logfmt::f_fma(logfmt::roundtrip_value(s_tab.lq, en, p.step, p.base, b), s_w[k], acc[i]);
            }
          } else {
            logfmt::accumulate_raw4(acc, w2, s_w[k]);
          }
        }
      }
      const uint2 o{bf16_bits(acc[0]) | static_cast<uint32_t>(bf16_bits(acc[1])) << 16,
                    bf16_bits(acc[2]) | static_cast<uint32_t>(bf16_bits(acc[3])) << 16};
      reinterpret_cast<uint2*>(a.out + static_cast<int64_t>(tok) * H + c0 + warp * logfmt::kGroup)[lane] = o;
    }
    __syncthreads();  // s_row / s_w / s_cast / s_par are rewritten by the next item
  }
  if (blockIdx.x == 0 && tid == 0) *at<volatile int>(local(c), kLlCalls) = static_cast<int>(s_seq);
}

}  // namespace
}  // namespace ll
}  // namespace deep_ep
