// ll_combine_recv.cuh: the receive half of the LL combine (every form that has one): the wait for
// the senders' signals, the routing check, then per token (over P blocks) the reduction of its
// selections' rows (rows), of its ranks' partial sums (partial) or of LogFMT rows. The two-launch
// receive kernel reads the call's half, number and format from recv_state (combine_recv).
#pragma once

#include <cstdint>
#include <type_traits>

#include "ll_combine_local.cuh"
#include "ll_combine_spread.cuh"
#include "logfmt.cuh"
#include "low_latency.cuh"

namespace deep_ep {
namespace ll {
namespace {


// LogFMT reduction of passes [pass_lo, pass_hi) of token `tok` (combine receive, blockDim =
// kReduceThreads), in windows of up to kLogfmtWindow groups (hidden <= 8192: one window per
// token): the block derives every selection's parameters of the window's groups from the meta (one
// latency, slot (k, g) per thread), then each chunk's cast decision, then per pass of 32 groups
// (4096 channels) thread j reduces channels 8j..8j+7: acc = fma(decoded value, w_k, acc) over k
// in order (crate: logfmt::decode_accumulate), one bf16 rounding, kLogfmtBatch selections' loads
// in flight before their decodes (one load per selection used at once made K serial latencies).
// Three barriers per window, not per pass (bench/NOTES.md session 44). The narrow form
// (recv_logfmt_half: only in combine's kLfRecvHalf instantiation, a LogFMT receive instantiation)
// halves each thread's chain of decodes (K x 4 instead of K x 8) where the grid has a
// block for every half pass (few tokens: the cast receive is latency-bound there, bench/NOTES.md
// session 40). s_e / s_w: the token's experts and weights.
static_assert(kReduceThreads == kMaxLlTopk * 32, "one thread per (selection, group) of a LogFMT pass");
constexpr int kLogfmtPass = 32;  // groups of 128 channels per pass
constexpr int kLogfmtHalf = kLogfmtPass / 2;  // the narrow form's
constexpr int kLogfmtWindow = 2 * kLogfmtPass;  // groups whose parameters one round of barriers derives
constexpr int kLogfmtBatch = 4;
// The number of LogFMT passes of `pass_groups` groups of 128 channels over a row of `hidden`
// channels (kLogfmtPass: the wide form's; kLogfmtHalf: the narrow form's). The one home of that
// count: the receive launcher's grid and the kernel's slices both use it.
__host__ __device__ __forceinline__ int logfmt_pass_count(int hidden, int pass_groups) {
  return (hidden / 128 + pass_groups - 1) / pass_groups;
}
// Whether a LogFMT receive of `n` tokens on `blocks` blocks takes the narrow form (a block per half
// pass of every token; recv_logfmt_half): the host's choice of the kLfRecvHalf instantiation and
// the kernel's of the form, one rule.
__host__ __device__ __forceinline__ bool logfmt_narrow(int64_t n, int64_t blocks, int hidden) {
  const int passes = logfmt_pass_count(hidden, kLogfmtPass), halves = logfmt_pass_count(hidden, kLogfmtHalf);
  return n > 0 && blocks / n >= halves && halves > passes;
}
// The LogFMT reduction a receive instantiation holds inline (combine_recv_tokens' kLf).
constexpr int kLfGeneric = 0, kLfWide = 1, kLfHalf = 2;
// In a LogFMT receive half `recv` (the layout of logfmt.cuh: meta words [E][T][S] u32, then the
// payload rows [E][T] of 2H bytes from byte `pay` = E*T*S*4): the payload row of (expert e, token
// tok), and its meta word of group g0 + g. Both receive forms read through these.
__device__ __forceinline__ const char* logfmt_recv_row(const char* recv, uint64_t pay, int T, int H, int64_t e, int tok) {
  return recv + pay + (static_cast<uint64_t>(e) * T + tok) * 2 * H;
}
__device__ __forceinline__ uint32_t logfmt_recv_meta(const char* recv, int T, int S, int64_t e, int tok, int g0, int g) {
  return __ldcg(reinterpret_cast<const unsigned int*>(recv + ((static_cast<uint64_t>(e) * T + tok) * S + g0 + g) * 4));
}

// One pass's reduction (the wide form): thread j reduces channels 8j..8j+7 (group base + tid / 16,
// `wg` = base - the window's first group) with the window's parameters in shared memory
// ([selection][group - window start]) and s_row[k], selection k's payload row of the token
// (nullptr: no row). The pointers are passed one by one: in a struct by reference an out-of-line
// caller read them from the stack and the arrays by generic loads (session 44).
__device__ __forceinline__ void recv_logfmt_units(const Args& a, int tok, const float* s_w, int base, int wg,
                                                  const int32_t (*s_step)[kLogfmtWindow], const int32_t (*s_base)[kLogfmtWindow],
                                                  const unsigned char (*s_cast)[kLogfmtWindow], const char* const* s_row) {
  constexpr int kPerGroup = 16, kCodeBytes = 10;  // units per group; a unit's bytes of 10-bit codes
  const int tid = threadIdx.x, K = a.num_topk, H = a.hidden;
  const int j = base * kPerGroup + tid, gl = tid / kPerGroup, m = tid % kPerGroup;  // unit j lies in group base + gl
  if (j * 8 >= H) return;
  const int gw = wg + gl;
  float acc[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
  for (int q0 = 0; q0 < K; q0 += kLogfmtBatch) {
    uint32_t wv[kLogfmtBatch][4];  // cast: the three words holding the unit's codes; raw: its bf16
    int kind[kLogfmtBatch];        // 0: no row (invalid or masked expert, past K), 1: cast, 2: raw
#pragma unroll
    for (int u = 0; u < kLogfmtBatch; ++u) {
      const int q = q0 + u;
      const char* row = q < K ? s_row[q] : nullptr;
      kind[u] = row == nullptr ? 0 : s_cast[q][gw] ? 1 : 2;
      if (kind[u] == 1) {
        const unsigned int* w = reinterpret_cast<const unsigned int*>(row + (base + gl) * 256 + (kCodeBytes * m & ~3));
        wv[u][0] = __ldcg(w);
        wv[u][1] = __ldcg(w + 1);
        wv[u][2] = __ldcg(w + 2);
        wv[u][3] = 0;
      } else if (kind[u] == 2) {
        const int4 v = __ldcg(reinterpret_cast<const int4*>(row) + j);
        wv[u][0] = static_cast<uint32_t>(v.x);
        wv[u][1] = static_cast<uint32_t>(v.y);
        wv[u][2] = static_cast<uint32_t>(v.z);
        wv[u][3] = static_cast<uint32_t>(v.w);
      }
    }
#pragma unroll
    for (int u = 0; u < kLogfmtBatch; ++u) {  // in order q = q0, q0 + 1, ...: the sums are unchanged
      const int q = q0 + u;
      if (kind[u] == 1) {
        const uint32_t w3[3] = {wv[u][0], wv[u][1], wv[u][2]};
        logfmt::accumulate_cast8(acc, w3, kCodeBytes * m & 3, s_step[q][gw], s_base[q][gw], s_w[q]);
      } else if (kind[u] == 2) {
        logfmt::accumulate_raw8(acc, wv[u], s_w[q]);
      }
    }
  }
  reinterpret_cast<int4*>(a.out + static_cast<int64_t>(tok) * H)[j] = pack_bf16x8(acc);
}

// The narrow form (only in combine's kLfRecvHalf instantiation, launched where logfmt_narrow
// holds): half pass `half` (kLogfmtHalf groups, 2048 channels) of token `tok`, thread j of the
// block reducing channels 4j..4j+3 of the half (group half * kLogfmtHalf + j / 32). Every load is
// issued before the block's one barrier: the unit's payload words of the first kLogfmtPre
// selections, both the cast words and the raw ones (which of the two a group holds is known only
// from its meta), beside the meta words of the half's (selection, group) slots. One memory latency
// then precedes the decodes where the window form has three (the meta, then two batches of
// selections). A chunk's cast decision is a vote of the lanes holding its groups' slots (slot
// (k, g) on thread k * kLogfmtHalf + g: a chunk's groups on consecutive lanes of one warp), not a
// second pass and barrier. kLogfmtPre: 8 held 32 registers of words across the barrier and ptxas
// spilled each right after its load (session 45).
constexpr int kLogfmtPre = 4;
static_assert(kMaxLlTopk * kLogfmtHalf <= kReduceThreads, "one thread per (selection, group) slot of a half pass");
// The LogFMT receives' parameters: the narrow form's (half) and the window form's (wide), part of
// the CombineRecvShared of the kernels that hold both forms inline (kLfHalf). The wide receive
// kernel (kLfWide) and the out-of-line form keep arrays of their own (ll_combine_recv_logfmt).
struct LogfmtRecvShared {
  struct {
    int32_t base[kMaxLlTopk][kLogfmtHalf], step[kMaxLlTopk][kLogfmtHalf];  // logfmt::decode_base, step_q
    unsigned char cast[kMaxLlTopk][kLogfmtHalf];
  } half;
  struct {
    int32_t base[kMaxLlTopk][kLogfmtWindow], step[kMaxLlTopk][kLogfmtWindow];
    unsigned char castable[kMaxLlTopk][kLogfmtWindow], cast[kMaxLlTopk][kLogfmtWindow];
    const char* row[kMaxLlTopk];
  } wide;
};
__device__ __forceinline__ void recv_logfmt_half(const Args& a, const char* recv, int tok, const int64_t* s_e, const float* s_w, int half,
                                                 LogfmtRecvShared& sh) {
  int32_t(&s_base)[kMaxLlTopk][kLogfmtHalf] = sh.half.base;
  int32_t(&s_step)[kMaxLlTopk][kLogfmtHalf] = sh.half.step;
  unsigned char(&s_cast)[kMaxLlTopk][kLogfmtHalf] = sh.half.cast;
  const int tid = threadIdx.x, K = a.num_topk, E = a.num_experts, T = a.num_max_tokens, H = a.hidden, S = H / 128;
  const int per_chunk = logfmt::chunk_channels(H) / 128;  // 4 or 8: divides kLogfmtHalf, so chunks start at slot runs
  const int base = half * kLogfmtHalf, ng = min(kLogfmtHalf, S - base);
  const uint64_t pay = static_cast<uint64_t>(E) * T * S * 4;  // the meta words precede the payload rows
  const int gl = tid / 32, m = tid % 32, j = base * 32 + tid;  // unit j: group base + gl, its m-th 4 channels
  const bool unit = gl < ng;
  const auto row_of = [&](int64_t e) { return logfmt_recv_row(recv, pay, T, H, e, tok); };
  // The unit's words of a row: the cast form's two code words, the raw form's four bf16.
  const auto load_cast = [&](const char* row, uint32_t (&w)[2]) {
    const unsigned int* p = reinterpret_cast<const unsigned int*>(row + (base + gl) * 256 + (5 * m & ~3));
    w[0] = __ldcg(p);
    w[1] = __ldcg(p + 1);
  };
  const auto load_raw = [&](const char* row, uint32_t (&w)[2]) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(row) + j);
    w[0] = v.x;
    w[1] = v.y;
  };
  uint32_t cw[kLogfmtPre][2], rw[kLogfmtPre][2];
#pragma unroll
  for (int k = 0; k < kLogfmtPre; ++k) {
    const int64_t e = k < K ? s_e[k] : -1;
    if (unit && e >= 0 && e < E) {
      const char* row = row_of(e);
      load_cast(row, cw[k]);
      load_raw(row, rw[k]);
    }
  }
  {
    const int k = tid / kLogfmtHalf, g = tid % kLogfmtHalf;
    const int64_t ek = k < K ? s_e[k] : -1;
    const bool slot = k < K && g < ng && ek >= 0 && ek < E;
    bool castable = true;  // slots past the half's groups do not hold a chunk back (the send's short last chunk)
    if (slot) {
      const logfmt::Group p = logfmt::group_of_meta(logfmt_recv_meta(recv, T, S, ek, tok, base, g));
      s_base[k][g] = logfmt::decode_base(p);
      s_step[k][g] = p.step_q;
      castable = p.castable;
    }
    const unsigned int votes = __ballot_sync(0xffffffffu, castable), run = (1u << per_chunk) - 1u;
    const int first = tid % 32 / per_chunk * per_chunk;  // the chunk's first lane
    if (slot) s_cast[k][g] = (votes >> first & run) == run;
  }
  __syncthreads();
  if (unit) {
    const int shift = 5 * m & 3;
    // Selection k's words as its chunk holds them (after the barrier: cast or raw is known).
    const auto load = [&](int k, uint32_t (&w)[2]) {
      const int64_t e = k < K ? s_e[k] : -1;
      if (e < 0 || e >= E) return;
      const char* row = row_of(e);
      if (s_cast[k][gl]) {
        load_cast(row, w);
      } else {
        load_raw(row, w);
      }
    };
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const auto add = [&](int k, const uint32_t (&c)[2], const uint32_t (&r)[2]) {  // in order k = 0, 1, ...
      const int64_t e = k < K ? s_e[k] : -1;
      if (e < 0 || e >= E) return;
      if (s_cast[k][gl]) {
        logfmt::accumulate_cast4(acc, c, shift, s_step[k][gl], s_base[k][gl], s_w[k]);
      } else {
        logfmt::accumulate_raw4(acc, r, s_w[k]);
      }
    };
    // Selections kLogfmtPre.. in batches of kLogfmtPre, each batch's loads in flight while the one
    // before it decodes (the first batch's words arrived with the meta).
    for (int k0 = 0; k0 < K; k0 += kLogfmtPre) {
      uint32_t nw[kLogfmtPre][2];
#pragma unroll
      for (int u = 0; u < kLogfmtPre; ++u) load(k0 + kLogfmtPre + u, nw[u]);
#pragma unroll
      for (int u = 0; u < kLogfmtPre; ++u) add(k0 + u, cw[u], rw[u]);
#pragma unroll
      for (int u = 0; u < kLogfmtPre; ++u) {
        cw[u][0] = rw[u][0] = nw[u][0];
        cw[u][1] = rw[u][1] = nw[u][1];
      }
    }
    const uint2 o{bf16_bits(acc[0]) | static_cast<uint32_t>(bf16_bits(acc[1])) << 16,
                  bf16_bits(acc[2]) | static_cast<uint32_t>(bf16_bits(acc[3])) << 16};
    reinterpret_cast<uint2*>(a.out + static_cast<int64_t>(tok) * H)[j] = o;
  }
  __syncthreads();  // the parameters are rewritten by the next item (and s_e / s_w by the next token)
}

// The window form's parameters are arrays of the caller's: the fields of LogfmtRecvShared::wide, or
// arrays of their own (the wide receive kernel's; the out-of-line form's).
__device__ __forceinline__ void ll_combine_recv_logfmt(const Args& a, const char* recv, int tok, const int64_t* s_e, const float* s_w,
                                                       int pass_lo, int pass_hi, int32_t (&s_base)[kMaxLlTopk][kLogfmtWindow],
                                                       int32_t (&s_step)[kMaxLlTopk][kLogfmtWindow],
                                                       unsigned char (&s_castable)[kMaxLlTopk][kLogfmtWindow],
                                                       unsigned char (&s_cast)[kMaxLlTopk][kLogfmtWindow], const char* (&s_row)[kMaxLlTopk]) {
  const int tid = threadIdx.x, K = a.num_topk, E = a.num_experts, T = a.num_max_tokens, H = a.hidden, S = H / 128;
  const int per_chunk = logfmt::chunk_channels(H) / 128;  // divides 16: windows and passes start at chunk starts
  const int g_lo = pass_lo * kLogfmtPass, g_hi = min(S, pass_hi * kLogfmtPass);
  const uint64_t pay = static_cast<uint64_t>(E) * T * S * 4;  // the meta words precede the payload rows
  if (tid < K) {  // read after the window's first barrier
    const int64_t e = s_e[tid];
    s_row[tid] = e < 0 || e >= E ? nullptr : logfmt_recv_row(recv, pay, T, H, e, tok);
  }
  for (int wb = g_lo; wb < g_hi; wb += kLogfmtWindow) {
    const int ng = min(kLogfmtWindow, g_hi - wb);
    // Slot i = (k, g): selection k's group wb + g, for every valid selection k (both loops below).
    const auto each_slot = [&](auto&& f) {
      for (int i = tid; i < K * kLogfmtWindow; i += static_cast<int>(blockDim.x)) {
        const int k = i / kLogfmtWindow, g = i % kLogfmtWindow;
        const int64_t ek = s_e[k];
        if (g < ng && ek >= 0 && ek < E) f(k, g, ek);
      }
    };
    each_slot([&](int k, int g, int64_t ek) {  // its parameters: one meta load per slot
      const logfmt::Group p = logfmt::group_of_meta(logfmt_recv_meta(recv, T, S, ek, tok, wb, g));
      s_base[k][g] = logfmt::decode_base(p);
      s_step[k][g] = p.step_q;
      s_castable[k][g] = p.castable;
    });
    __syncthreads();
    each_slot([&](int k, int g, int64_t) {  // a chunk is cast when all its groups are castable
      const int q0 = g / per_chunk * per_chunk, q1 = min(q0 + per_chunk, ng);
      unsigned char all = 1;
      for (int q = q0; q < q1; ++q) all &= s_castable[k][q];
      s_cast[k][g] = all;
    });
    __syncthreads();
    for (int base = wb; base < wb + ng; base += kLogfmtPass) {
      recv_logfmt_units(a, tok, s_w, base, base - wb, s_step, s_base, s_cast, s_row);
    }
    __syncthreads();  // the parameters are rewritten by the next window (and s_e / s_w / s_row by the next token)
  }
}

// The LogFMT reduction in the receives that are not the LogFMT receive instantiation (kLfRecv): a
// wrong format hint, overlap or seam calls. Out of line, so that its registers stay apart from the
// BF16 / partial rows' (inline, the window form spilled 20 bytes in the shared NvlNet kernel and
// cost the hook step's receive 0.16 µs, session 44).
// The window form with parameter arrays of its own, one set per kOwner (each instantiation's arrays
// are symbols of their own): kOwner 0 the out-of-line form's, 1 the wide receive kernel's.
template <int kOwner>
__device__ __forceinline__ void recv_logfmt_own_arrays(const Args& a, const char* recv, int tok, const int64_t* s_e, const float* s_w,
                                                       int pass_lo, int pass_hi) {
  __shared__ int32_t s_base[kMaxLlTopk][kLogfmtWindow], s_step[kMaxLlTopk][kLogfmtWindow];
  __shared__ unsigned char s_castable[kMaxLlTopk][kLogfmtWindow], s_cast[kMaxLlTopk][kLogfmtWindow];
  __shared__ const char* s_row[kMaxLlTopk];
  ll_combine_recv_logfmt(a, recv, tok, s_e, s_w, pass_lo, pass_hi, s_base, s_step, s_castable, s_cast, s_row);
}
__device__ __noinline__ void recv_logfmt_out_of_line(const Args& a, const char* recv, int tok, const int64_t* s_e, const float* s_w,
                                                     int pass_lo, int pass_hi) {
  recv_logfmt_own_arrays<0>(a, recv, tok, s_e, s_w, pass_lo, pass_hi);  // one symbol for every kernel calling this function (cold paths)
}

// combine_recv_tokens' shared memory, declared at the scope of the kernel (`combine`) so that it
// is that kernel's own: that function is inlined by several kernels, and its function-scope
// variables were one symbol across them (the reason: DispatchShared in ll_dispatch.cu). kRows:
// kMaxLlTopk where kOwn reads `row`, else 1. kLfInline: the kernel holds both LogFMT receive forms
// inline (kLfHalf; their parameters `lf`).
struct NoLogfmtRecvShared {};
template <int kRows, bool kLfInline = false>
struct CombineRecvShared {
  int ok, npart, state[3];
  int live[kMaxLlRanks];  // ranks whose words arrived (their format words are checked)
  unsigned long long wait[kMaxLlRanks];
  int64_t e[kMaxLlTopk];
  float w[kMaxLlTopk];
  int part[kMaxLlTopk];  // partial sums: the token's distinct expert ranks, ascending
  int dead[kMaxLlRanks];  // the rank mask, read once (no shrink mode: it cannot change during the call)
  const char* row[kRows];  // kOwn: selection k's row
  unsigned long long fp[kReduceThreads / 32], fpw[kReduceThreads / 32];  // check_routing_at's per-warp shares
  std::conditional_t<kLfInline, LogfmtRecvShared, NoLogfmtRecvShared> lf;
};

// Every block waits for all E words (partial: the R words d*E_l) of call `seq` on `half`, then
// reduces work items blockIdx.x, +gridDim.x, ...: item w = slice w % P of token w / P (P blocks
// share a token when there are more blocks than tokens: a 1-token combine is not one block's
// loads; LogFMT: passes of groups, ll_combine_recv_logfmt); thread j of a slice owns channels 8j..8j+7: acc = fma(y_k, w_k, acc)
// over k in order (crate: f32::mul_add); partial: acc += the partial row of each expert rank d
// ascending that holds one of the token's (unmasked) experts.
// kRowBatch: rows' loads in flight per thread before their FMAs (per-expert rows). kOwn (the
// one-launch kernel, rows, own_rows_direct): a selection of this rank's experts reads its row where
// the send left it (its index at the row's place: x or the zero-copy slot; an index outside the
// expert's rows drops the selection, so no stale word can send a load out of bounds). kState (the
// receive launch): thread 0 reads half, seq and the format from recv_state before the block's
// first barrier, beside the mask loads, and the routing check reads the copies its send kernel
// made (check_routing); a one-launch kernel's reads the dispatch's words (check_routing_direct).
// Before the wait, warp 0 loads the block's first token's ids and weights (the caller's tensors),
// and the format words are checked after the rows: neither is a latency between wait and rows.
template <class Net, int kRowBatch = 4, bool kOwn = false, bool kState = false, int kLf = kLfGeneric, int kRows = 1, bool kLfInline = false>
__device__ __forceinline__ void combine_recv_tokens(const Ctx& c, const Args& a, int half, uint32_t seq, bool partial, bool logfmt,
                                                    CombineRecvShared<kRows, kLfInline>& sh) {
  static_assert(kLf != kLfHalf || kLfInline, "the inline LogFMT receive forms need their parameters' memory");
  int &s_ok = sh.ok, &s_npart = sh.npart;
  int(&s_state)[3] = sh.state;
  int(&s_live)[kMaxLlRanks] = sh.live;
  unsigned long long(&s_wait)[kMaxLlRanks] = sh.wait;
  int64_t(&s_e)[kMaxLlTopk] = sh.e;
  float(&s_w)[kMaxLlTopk] = sh.w;
  int(&s_part)[kMaxLlTopk] = sh.part;
  int(&s_dead)[kMaxLlRanks] = sh.dead;
  const char*(&s_row)[kRows] = sh.row;
  const int tid = threadIdx.x, R = c.num_ranks, El = a.num_experts / R, E = a.num_experts, T = a.num_max_tokens, H = a.hidden;
  const int K = a.num_topk;
  const bool snap = a.shrink_mask == nullptr;  // shrink mode: a wait may mask a rank, read the mask each time
  const auto masked = [&](int d) { return snap ? s_dead[d] != 0 : rank_masked(a, d); };
  if (tid == 0) {
    s_ok = 1;
    if (kState) {
      int h = 0, fl = 0;
      uint32_t q = 0;
      s_ok = read_state(c, a, DEK_LL_KIND_COMBINE, false, DEK_IC_SITE_LL_COMBINE, &h, &q, &fl);
      s_state[0] = h;
      s_state[1] = static_cast<int>(q);
      s_state[2] = fl;
    }
  }
  for (int d = tid; d < R; d += blockDim.x) {
    s_wait[d] = 0;
    s_live[d] = 0;
  }
  // kState: warps 1.. read the mask, thread 0 recv_state (on one thread they were in a chain).
  const int first = kState ? 32 : 0;
  for (int d = tid - first; snap && d >= 0 && d < R; d += static_cast<int>(blockDim.x) - first) s_dead[d] = rank_masked(a, d);
  __syncthreads();
  if (kState) {
    if (!s_ok) return;
    half = s_state[0];
    seq = static_cast<uint32_t>(s_state[1]);
    partial = (s_state[2] & DEK_LL_FLAG_PARTIAL) != 0;
    logfmt = (s_state[2] & DEK_LL_FLAG_LOGFMT) != 0;
  }
  char* me = local(c);
  const int U = H / 8, N = a.num_tokens, blocks = static_cast<int>(gridDim.x);
  // A token over P blocks: slices of U / P units, LogFMT: of its passes (kLogfmtPass groups each),
  // kLfHalf: a block per half pass of every token when the grid has them (logfmt_narrow).
  const int passes = logfmt_pass_count(H, kLogfmtPass), halves = logfmt_pass_count(H, kLogfmtHalf);
  const bool narrow = kLf == kLfHalf && logfmt && logfmt_narrow(N, blocks, H);
  const int P = N < 1 ? 1 : narrow ? halves : max(1, min(blocks / N, logfmt ? passes : static_cast<int>((U + blockDim.x - 1) / blockDim.x)));
  int64_t e0 = -1;  // warp 0: the first item's selection tid (its loads in flight across the wait)
  float w0 = 0.0f;
  if (tid < K && static_cast<int>(blockIdx.x) < N * P) {
    const int64_t j = static_cast<int64_t>(blockIdx.x / P) * K + tid;
    e0 = topk_at(a, j);
    w0 = a.topk_weights[j];
  }
  for (int w = tid; w < E; w += blockDim.x) {
    if (masked(w / El)) continue;  // a masked rank returns nothing and is not waited for
    if (partial && w % El != 0) continue;  // partial: one word per expert rank
    const long long t0 = clock64();
    uint32_t v = 0;
    bool gave_up = false;
    const int got = wait_from<Net>(c, a, w / El, at<const uint32_t>(me, sig_off(a, half) + static_cast<uint64_t>(w) * 4), kSeamCombine, half,
                                   w % El, seq, DEK_IC_SITE_LL_COMBINE, &v, &gave_up);
    if (gave_up) abandon_call<Net>(c, a, kSeamCombine, half, seq, a.shrink_mask != nullptr ? w / El : -1, partial);
    if (got < 0) {
      s_ok = 0;
      break;
    }
    if (got == 0) continue;  // shrink mode masked the rank: its experts are dropped below
    // Only when asked: a 64-bit shared atomicMax is a compare-and-swap loop on one word.
    if (a.wait_stats != nullptr) atomicMax(&s_wait[w / El], static_cast<unsigned long long>(clock64() - t0));
    if (w % El == 0) s_live[w / El] = 1;
  }
  __syncthreads();
  if (!s_ok) return;
  if (blockIdx.x == gridDim.x - 1) {  // with N * P < the grid it has no item
    if (kState) check_routing(c, a, half, sh.fp, sh.fpw);
    else check_routing_direct(c, a, sh.fp, sh.fpw);
  }
  for (int d = tid; blockIdx.x == 0 && d < R && a.wait_stats != nullptr; d += blockDim.x) {
    atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + d), s_wait[d]);
  }
  const char* recv = me + recv_off(a, half);
  const uint64_t row_bytes = 2 * static_cast<uint64_t>(H);
  const bool own = kOwn && !partial && !logfmt && own_rows(a);
  const int64_t RT = static_cast<int64_t>(R) * T;
  const uint64_t zc_row = 2 * static_cast<uint64_t>(H + H / 128 * 2);  // a zero-copy slot row's bytes
  for (int item = blockIdx.x; item < N * P; item += blocks) {
    const int tok = item / P, u_lo = (item % P) * U / P, u_hi = (item % P + 1) * U / P;
    if (tid < 32) {  // warp 0, lane k: selection k (K <= kMaxLlTopk <= 32)
      int64_t e = -1;
      if (tid < K) {
        const bool first = item == static_cast<int>(blockIdx.x);
        e = first ? e0 : topk_at(a, static_cast<int64_t>(tok) * K + tid);
        if (e >= 0 && e < E && masked(static_cast<int>(e / El))) e = -1;  // experts of masked ranks: dropped
        if constexpr (kOwn) {
          const char* row = nullptr;
          if (e >= 0 && e < E) {
            row = recv + static_cast<uint64_t>(e) * T * row_bytes + static_cast<uint64_t>(tok) * row_bytes;
            if (own && e / El == c.rank) {
              const int64_t idx = __ldcg(reinterpret_cast<const long long*>(row)), l = e % El;
              const bool in = idx >= l * RT && idx < (l + 1) * RT;
              row = !in ? nullptr : a.zero_copy ? me + send_off(a, half) + static_cast<uint64_t>(idx) * zc_row
                                                : static_cast<const char*>(a.x) + static_cast<uint64_t>(idx) * row_bytes;
              if (!in) e = -1;
            }
          }
          s_row[tid] = row;
        }
        s_e[tid] = e;
        s_w[tid] = first ? w0 : a.topk_weights[static_cast<int64_t>(tok) * K + tid];
      }
      // The distinct ranks of the valid experts, ascending.
      const bool valid = e >= 0 && e < E;
      const int d = valid ? static_cast<int>(e / El) : 0;
      const RankList part = rank_list(valid, d);
      if (part.first) s_part[part.idx] = d;
      if (tid == 0) s_npart = part.count;
    }
    __syncthreads();
    if (partial) {
      for (int j = u_lo + tid; j < u_hi; j += blockDim.x) {
        float acc[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
        for (int i = 0; i < s_npart; ++i) {
          const int d = s_part[i];
          const int4 v = __ldcg(reinterpret_cast<const int4*>(recv + a.partial_off + (static_cast<uint64_t>(d) * T + tok) * row_bytes) + j);
          const uint32_t wv[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            acc[2 * u] = __fadd_rn(acc[2 * u], bf16_to_f32(wv[u] & 0xffffu));
            acc[2 * u + 1] = __fadd_rn(acc[2 * u + 1], bf16_to_f32(wv[u] >> 16));
          }
        }
        reinterpret_cast<int4*>(a.out + static_cast<int64_t>(tok) * H)[j] = pack_bf16x8(acc);
      }
      __syncthreads();  // s_e, s_w, s_part are rewritten for the next token
      continue;
    }
    if (logfmt) {
      const int np = narrow ? halves : passes, lo = (item % P) * np / P, hi = (item % P + 1) * np / P;
      if constexpr (kLf == kLfHalf) {
        auto& w = sh.lf.wide;
        if (narrow) {
          recv_logfmt_half(a, recv, tok, s_e, s_w, lo, sh.lf);  // lo = item % P: one half pass (P = np = halves)
        } else {
          ll_combine_recv_logfmt(a, recv, tok, s_e, s_w, lo, hi, w.base, w.step, w.castable, w.cast, w.row);
        }
      } else if constexpr (kLf == kLfWide) {
        // Inline (a call here made the kernel spill around its waits), its parameters in arrays of its
        // own (the wide receive kernel's alone): with them in one struct ptxas kept 8 bytes of this
        // kernel on the stack (bench/NOTES.md session 48).
        recv_logfmt_own_arrays<1>(a, recv, tok, s_e, s_w, lo, hi);
      } else {
        recv_logfmt_out_of_line(a, recv, tok, s_e, s_w, lo, hi);
      }
      continue;
    }
    for (int j = u_lo + tid; j < u_hi; j += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
      // kRowBatch rows' loads in flight before their FMAs (each load used at once made K serial
      // latencies); the FMAs keep the order k = 0, 1, ... so the sums are unchanged.
      for (int k0 = 0; k0 < K; k0 += kRowBatch) {
        int4 v[kRowBatch];
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
          const int64_t e = k0 + u < K ? s_e[k0 + u] : -1;
          if (e >= 0 && e < E) {
            const char* row = kOwn ? s_row[k0 + u] : recv + (static_cast<uint64_t>(e) * T + tok) * row_bytes;
            v[u] = __ldcg(reinterpret_cast<const int4*>(row) + j);
          }
        }
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
          const int64_t e = k0 + u < K ? s_e[k0 + u] : -1;
          if (e < 0 || e >= E) continue;
          const uint32_t wv[4] = {static_cast<uint32_t>(v[u].x), static_cast<uint32_t>(v[u].y), static_cast<uint32_t>(v[u].z), static_cast<uint32_t>(v[u].w)};
          fma_bf16x8(acc, wv, s_w[k0 + u]);
        }
      }
      reinterpret_cast<int4*>(a.out + static_cast<int64_t>(tok) * H)[j] = pack_bf16x8(acc);
    }
    __syncthreads();  // s_e / s_w are rewritten for the next token
  }
  // Block 0: the senders' format words, after the rows. The reduction read this rank's own layout
  // only, so a sender of another format changed nothing outside the call's output, which a
  // raising call leaves unspecified.
  for (int d = tid; blockIdx.x == 0 && d < R; d += blockDim.x) {
    if (s_live[d] && !remote<Net>(c, a, d)) fmt_agrees(c, a, 1, half, d, fmt_combine(logfmt, partial), DEK_IC_SITE_LL_COMBINE);
  }
}

// The receive launch: the call's half, number and format from recv_state (written by the send).
// kLf: which LogFMT reduction the instantiation holds inline (kLfWide: the wide form, combine's
// kLfRecv; kLfHalf: both forms, its kLfRecvHalf; kLfGeneric: none, the wide form out of line).
template <class Net, int kLf = kLfGeneric, int kRows = 1, bool kLfInline = false>
__device__ __forceinline__ void combine_recv(const Ctx& c, const Args& a, CombineRecvShared<kRows, kLfInline>& sh) {
  combine_recv_tokens<Net, 8, false, true, kLf>(c, a, 0, 0, false, false, sh);
}

}  // namespace
}  // namespace ll
}  // namespace deep_ep
