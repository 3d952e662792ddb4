// ll_dispatch.cu: low-latency dispatch, send and receive kernels (deduplicated wire format: one
// message per (token, destination rank), fanned out to the expert rows by the receiver).
// Protocol: deep_ep_kernels.h ("Low-latency mode"); shared helpers: low_latency.cuh; the send's
// casts (FP8, NVFP4): ll_cast.cuh.
#include <algorithm>
#include <cstdint>
#ifdef DEEP_EP_LL_STAMPS
#include <cstdio>
#endif

#include "ll_cast.cuh"
#include "low_latency.cuh"

namespace deep_ep {
namespace ll {
namespace {

// ---- one rank: the rows straight into the outputs --------------------------------------------------
// One warp's cast groups [g0, min(g0 + kBatch, g_hi)) of the current token (v: the BF16 loads, q /
// inv: the FP8 or NVFP4 codes and scales) stored into every kept selection's row (local expert l,
// slot i) of recv_x and the scales, in the receive's layouts: FP8 scales f32 (or UE8M0 bytes of the
// packed int32) at scale_stride, NVFP4 scale bytes in the 128x4 swizzle. R == 1: the rows of an
// expert are its slots.
template <bool kFp4, int kBatch>
__device__ __forceinline__ void local_rows(const Args& a, int g0, int g_hi, int lane, int ndst, const int* n,
                                           const uint32_t (*ent)[kMaxLlTopk], const uint2 (&v)[kBatch], const uint32_t (&q)[kBatch],
                                           const float (&inv)[kBatch]) {
  const int64_t T = a.num_max_tokens, H = a.hidden;
  const int64_t row_bytes = a.use_fp8 ? H : kFp4 ? H / 2 : 2 * H;
  for (int i = 0; i < ndst; ++i) {
    for (int p = 0; p < n[i]; ++p) {
      const uint32_t en = ent[i][p];
      const int64_t l = en >> 16, slot = en & 0xffffu;
      char* xr = static_cast<char*>(a.recv_x) + (l * T + slot) * row_bytes;
      if (a.use_fp8) {
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int g = g0 + u;
          if (g >= g_hi) break;
          *reinterpret_cast<uint32_t*>(xr + g * 128 + lane * 4) = q[u];
        }
        // Lane u stores group g0 + u's scale (the same in every lane): one store per lane instead of
        // a batch of them in lane 0 (scattered: the scales are column-major). f32 at g * stride, or
        // byte g % 4 of the UE8M0 int32 at (g / 4) * stride.
        const int g = g0 + lane;
        if (lane < kBatch && g < g_hi) {
          float mine = inv[0];
#pragma unroll
          for (int u = 1; u < kBatch; ++u) mine = lane == u ? inv[u] : mine;
          char* sr = static_cast<char*>(a.recv_scales) + 4 * (l * a.scale_stride[0] + slot * a.scale_stride[1]);
          const int64_t ss = 4 * a.scale_stride[2];
          if (a.use_ue8m0) {
            *reinterpret_cast<uint8_t*>(sr + (g / 4) * ss + g % 4) = static_cast<uint8_t>((__float_as_uint(mine) >> 23) & 0xffu);
          } else {
            *reinterpret_cast<float*>(sr + g * ss) = mine;
          }
        }
      } else if (kFp4) {  // H/2 bytes of codes; scale byte j = 8g + lane/4 at its swizzled place
        const int64_t rk = H / 64;
        unsigned char* sr = static_cast<unsigned char*>(a.recv_scales) + (l * ((T + 127) / 128) + slot / 128) * rk * 512 + (slot % 32) * 16 +
                            ((slot % 128) / 32) * 4 + (lane / 4) % 4 + (lane / 16) * 512;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int g = g0 + u;
          if (g >= g_hi) break;
          *reinterpret_cast<uint16_t*>(xr + g * 64 + lane * 2) = static_cast<uint16_t>(q[u]);
          if (lane % 4 == 0) sr[g * 1024] = static_cast<uint8_t>(__float_as_uint(inv[u]));  // j / 4 = 2g + lane / 16
        }
      } else {
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int g = g0 + u;
          if (g >= g_hi) break;
          *reinterpret_cast<uint2*>(xr + g * 256 + lane * 8) = v[u];
        }
      }
    }
  }
}

// Blocks per token of the one-rank dispatch (its launcher gives N * P token blocks when P > 1).
__host__ __device__ __forceinline__ int local_split(int n, int blocks) { return n >= 1 && blocks > n ? blocks / n : 1; }
// The dispatch send's payload warps: warp 0 of a token block routes only.
constexpr int kPayWarps = kSendWarps - 1;
// Blocks per token of the split peer one-launch dispatch (kSplit), over at most `blocks`: one group per payload warp at most.
__host__ __device__ __forceinline__ int peer_split(int n, int blocks, int groups) {
  return n < 1 || blocks / n < 2 || groups / kPayWarps < 2 ? 1 : blocks / n < groups / kPayWarps ? blocks / n : groups / kPayWarps;
}

// Block 0's routing words of this call (the combine checks its ids and weights against them):
// the sealed sums of the per-warp fingerprint shares of N tokens' K selections.
__device__ __forceinline__ void seal_routing(const Ctx& c, const Args& a, const unsigned long long* fp, const unsigned long long* fpw, int N, int K) {
  uint64_t* words = at<uint64_t>(local(c), kLlRouting);
  words[a.half] = routing_seal(shares_sum_u64(fp, kSendWarps), N, K);
  words[4 + a.half] = a.topk_weights != nullptr ? routing_seal(shares_sum_u64(fpw, kSendWarps), N, K) : 0;
}

// The one-rank count block's work after the counting pass (block 0 of dek_ll_dispatch_local), out
// of line so that the token blocks' path (set-up, routing, payload) is one contiguous stretch of
// code instead of jumping over this (bench/NOTES.md session 27): the routing fingerprints, the
// receive's outputs of the one source (R == 1: E_l == E) with the overflow reports, the call's end,
// then the message count and the format words.
__device__ __noinline__ void local_count_tail(const Ctx& c, const Args& a, const unsigned long long* s_fp, const unsigned long long* s_fpw,
                                              const int* s_total, const int* s_mask, const int* s_rct, uint32_t seq) {
  const int tid = threadIdx.x, E = a.num_experts, T = a.num_max_tokens;
  if (tid == 0) seal_routing(c, a, s_fp, s_fpw, a.num_tokens, a.num_topk);
  for (int e = tid; e < E; e += kSendThreads) {
    const int n = min(s_total[e], T);
    a.layout_range[e] = n;
    a.recv_count[e] = n;
    if (a.cumulative != nullptr) a.cumulative[e] += n;
    if (s_total[e] > T && !s_mask[0]) report(c, DEK_IC_ERR_OVERFLOW, 0, DEK_IC_SITE_LL_DISPATCH, s_total[e], T);
  }
  if (tid == 0) end_call(c, seq);
  if (a.net == nullptr && tid == 0 && !s_mask[0]) {
    *reinterpret_cast<uint32_t*>(window(c, 0) + recv_off(a, a.half) + 4 * c.rank) = static_cast<uint32_t>(s_rct[0]);
    put_fmt(c, a, 0, 0, fmt_dispatch(a));
  }
  LL_STAMP(10);
}

// The dispatch kernel's shared memory, declared at its scope (`dispatch`) and handed down: a helper's
// function-scope __shared__ is one symbol in every kernel inlining it, placed at one address in all
// (holes, moved by new kernels: bench/NOTES.md session 47); kernel scope is each kernel's own.
struct DispatchSendShared {
  uint32_t seq;
  int skip, last, ndst, any_far;
  int before[kMaxLlExperts], total[kMaxLlExperts];
  int rc[kMaxLlRanks], rct[kMaxLlRanks], mask[kMaxLlRanks];
  // The current token's destinations i < ndst (its distinct ranks, ascending): rank, entries,
  // message slot, and the entries (expert << 16 | slot) and weights in k order.
  int dst[kMaxLlTopk], n[kMaxLlTopk], msg[kMaxLlTopk];
  uint32_t ent[kMaxLlTopk][kMaxLlTopk];
  float w[kMaxLlTopk][kMaxLlTopk];
  unsigned long long fp[kSendWarps], fpw[kSendWarps];  // block 0: per-warp shares of the routing fingerprints (kLlRouting)
};
struct DispatchColumnShared {
  int ok;
  int cnt[kMaxLlRanks], begin[kMaxLlRanks + 1];
};
struct DispatchRecvShared {
  int ok, half, mask[kMaxLlRanks];
  uint32_t seq;
};
struct DispatchShared {
  DispatchSendShared send;
  DispatchColumnShared column;
  DispatchRecvShared recv;
};

// ---- dispatch send ------------------------------------------------------------------------------
// Block b owns tokens [b*per, (b+1)*per). Every block first counts, in shared memory, the
// selections of each expert over all tokens (s_total, for the signals) and over the tokens before
// its own (s_before: the expert slots), and the messages each rank gets from those earlier tokens
// (s_rc: message slots). Then per token (in order) warp 0 routes its top-k entries (slot order =
// (token, k) order, as the CPU backend's), and the warps split the token's 128-channel groups:
// each group is loaded (and cast to FP8) once and stored into every destination's message. The
// last block to finish release-stores every (rank, local expert) count. A destination outside the
// NVLink domain (internode) gets the same bytes by seam puts from the staging area of the send half
// (deep_ep_kernels.h): per token its meta and the payload (staged once for all remote
// destinations), at the end its count, index rows and signals.
// kLocal (one rank, dek_ll_dispatch_local): each selection's row goes straight into recv_x / the
// scales at (local expert, slot), src_info is written beside the message meta, and block 0 writes
// recv_count / layout_range / the stats from the counting pass: no payload in the message, no index
// entry, no signal, no receive. The meta and the count word stay (a later partial combine reads them).
// Returns false when the buffer timed out (nothing sent); *seq: this call's number; *mask: the
// block's copy of the rank mask (shared memory), read once at its start.
template <class Net, bool kFp4, bool kLocal, bool kSplit = false>
__device__ __forceinline__ bool dispatch_send(const Ctx& c, const Args& a, uint32_t* seq, const int** mask, DispatchSendShared& sh) {
  uint32_t& s_seq = sh.seq;
  int &s_skip = sh.skip, &s_last = sh.last, &s_ndst = sh.ndst, &s_any_far = sh.any_far;
  int(&s_before)[kMaxLlExperts] = sh.before;
  int(&s_total)[kMaxLlExperts] = sh.total;
  int(&s_rc)[kMaxLlRanks] = sh.rc;
  int(&s_rct)[kMaxLlRanks] = sh.rct;
  int(&s_mask)[kMaxLlRanks] = sh.mask;
  int(&s_dst)[kMaxLlTopk] = sh.dst;
  int(&s_n)[kMaxLlTopk] = sh.n;
  int(&s_msg)[kMaxLlTopk] = sh.msg;
  uint32_t(&s_ent)[kMaxLlTopk][kMaxLlTopk] = sh.ent;
  float(&s_w)[kMaxLlTopk][kMaxLlTopk] = sh.w;
  unsigned long long(&s_fp)[kSendWarps] = sh.fp;
  unsigned long long(&s_fpw)[kSendWarps] = sh.fpw;
  *mask = s_mask;
  if (!begin_send(c, a, DEK_LL_KIND_DISPATCH, &s_seq, &s_skip)) return false;
  *seq = s_seq;
  LL_STAMP(1);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, E = a.num_experts, El = E / R, T = a.num_max_tokens, H = a.hidden, S = H / 128;
  const int N = a.num_tokens, K = a.num_topk;
  // kLocal: block 0 is the count block (every count, the outputs that need them, the tail; no
  // token) and token block b = blockIdx.x - 1 of NB counts only the tokens before its own (its
  // slots). More token blocks than tokens (local_split; kSplit: peer_split): P per token, block b the
  // groups [S * (b % P) / P, S * (b % P + 1) / P) of token b / P. Otherwise the whole groups of
  // `per` tokens.
  const int b = static_cast<int>(blockIdx.x) - (kLocal ? 1 : 0), NB = static_cast<int>(gridDim.x) - (kLocal ? 1 : 0);
  const bool count_block = kLocal && b < 0;
  const int P = kLocal ? local_split(N, NB) : kSplit ? peer_split(N, min(NB, 64), S) : 1, slice = (kLocal || kSplit) && b >= 0 ? b % P : 0;
  // ceil(N / NB), in gridDim's unsigned arithmetic rather than NB's: the peer forms' PTX stays as it was.
  const int per = P > 1 ? 1 : (N + gridDim.x - (kLocal ? 2 : 1)) / (gridDim.x - (kLocal ? 1 : 0));
  const int t_begin = count_block ? N : min(N, b / P * per), t_end = min(N, t_begin + per);
  const int n_count = kLocal && !count_block ? t_begin : N;  // the tokens this block counts
  for (int e = tid; e < E; e += kSendThreads) s_before[e] = s_total[e] = 0;
  for (int d = tid; d < R; d += kSendThreads) {
    s_rc[d] = s_rct[d] = 0;
    s_mask[d] = rank_masked(a, d);
  }
  __syncthreads();
  LL_STAMP(8);
  uint64_t fp = 0, fpw = 0;  // block 0: this thread's shares of the fingerprints of topk_idx and topk_weights
  // One top-k entry per lane (was one token per thread, whose serial 16-way loop was the largest
  // part of a 1-token send: bench/LL_PROFILE.md section 2). A token's entries sit in one aligned
  // group of kp lanes (kp = K rounded up to a power of 2); the first lane of each (token, rank)
  // pair counts the token's message to that rank; counts are sums, the same in any order.
  const int kp = K <= 1 ? 1 : 1 << (32 - __clz(K - 1));
  const int per_warp = 32 / kp, k = lane % kp;
  for (int t0 = warp * per_warp; t0 < n_count; t0 += kSendWarps * per_warp) {  // the same bounds for the whole warp
    const int tok = t0 + lane / kp;
    const bool entry = tok < N && k < K;
    const int64_t j = static_cast<int64_t>(tok) * K + k;
    const int64_t e = entry ? topk_at(a, j) : -1;
    int dest = -1;  // the rank this entry's token goes to through it (-1: dropped)
    if (entry) {
      if ((e < -1 || e >= E) && blockIdx.x == 0) {  // raised at the next call (the cpu backend raises at once)
        report(c, DEK_IC_ERR_EXPERT_ID, c.rank, DEK_IC_SITE_LL_DISPATCH, static_cast<int>(max(min(e, int64_t{INT32_MAX}), int64_t{INT32_MIN})), E);
      }
      if (e >= 0 && e < E && !s_mask[e / El]) {  // else no expert, or one of a masked rank: dropped
        atomicAdd(&s_total[e], 1);
        if (tok < t_begin) atomicAdd(&s_before[e], 1);
        dest = static_cast<int>(e / El);
      }
      if (blockIdx.x == 0) {
        fp += routing_mix(j, e);
        if (a.topk_weights != nullptr) fpw += routing_mix(j, __float_as_uint(a.topk_weights[j]));
      }
    }
    if constexpr (kLocal) {
      // One rank: a token's message is its routed group's first lane; the warp's leaders are
      // counted by ballots and added once (was a match and up to 8 atomics on the same word per
      // warp and round: bench/NOTES.md session 26).
      const int g0 = (lane / kp) * kp;
      const unsigned routed = __ballot_sync(0xffffffffu, dest >= 0), group = kp >= 32 ? ~0u : ((1u << kp) - 1u) << g0;
      const bool leader = dest >= 0 && (routed & group & ((1u << lane) - 1u)) == 0;
      const unsigned leads = __ballot_sync(0xffffffffu, leader), early = __ballot_sync(0xffffffffu, leader && tok < t_begin);
      if (lane == 0 && leads != 0) {
        atomicAdd(&s_rct[0], __popc(leads));
        if (early != 0) atomicAdd(&s_rc[0], __popc(early));
      }
    } else {
      // Lanes of the same token and rank (a key no other lane has when dropped).
      const unsigned same = __match_any_sync(0xffffffffu, dest < 0 ? -1 - lane : (lane / kp) * kMaxLlRanks + dest);
      if (dest >= 0 && (same & ((1u << lane) - 1u)) == 0) {
        atomicAdd(&s_rct[dest], 1);
        if (tok < t_begin) atomicAdd(&s_rc[dest], 1);
      }
    }
  }
  if (blockIdx.x == 0) warp_shares_u64(fp, fpw, s_fp, s_fpw);  // uniform in the block: every lane takes part
  __syncthreads();
  LL_STAMP(9);
  if (kLocal && count_block) {
    local_count_tail(c, a, s_fp, s_fpw, s_total, s_mask, s_rct, s_seq);
    return true;
  }
  if (!kLocal && blockIdx.x == 0 && tid == 0) seal_routing(c, a, s_fp, s_fpw, N, K);
  const uint64_t recv = recv_off(a, a.half), msgs = recv + a.msgs_off;
  // NVLink only: every block counted every rank's messages, so block 0 stores the message counts
  // (read by a partial combine) and the format words now, ordered before the signals by its ticket
  // fence, instead of the last block between two fences after the ticket (one system fence fewer
  // on the critical path). With a seam the last block still writes them (staged for the puts).
  if (!kLocal && blockIdx.x == 0 && !has_seam<Net>(a)) {
    for (int d = tid; d < R; d += kSendThreads) {
      if (s_mask[d]) continue;
      *reinterpret_cast<uint32_t*>(window(c, d) + recv + 4 * c.rank) = static_cast<uint32_t>(s_rct[d]);
      put_fmt(c, a, 0, d, fmt_dispatch(a));
    }
  }
  LL_STAMP(10);
  // Staging of remote messages (send half of this call): payload of token tok at tok * pay_stride.
  const uint64_t stage = send_off(a, a.half), pay_stride = a.msg_bytes - kMsgMeta;
  const int s_lo = S * slice / P, s_hi = S * (slice + 1) / P;
  // Warp 0 routes only and warps 1.. carry the payload, loading and casting their first batch of
  // each token while warp 0 routes (the cast does not need the routing; bench/NOTES.md session 28).
  const int pw = warp - 1;  // payload warp (-1: the routing warp)
  const int gpw = (s_hi - s_lo + kPayWarps - 1) / kPayWarps, g_lo = pw < 0 ? s_hi : min(s_hi, s_lo + pw * gpw), g_hi = min(s_hi, g_lo + gpw);
  constexpr int kBatch = 8;
  const float gscale = kFp4 ? __ldg(a.x_global_scale) : 0.0f;
  bool put_any = false;  // this warp put to a remote destination (flushed at the end)
  uint2 v[kBatch]; uint32_t q[kBatch]; float inv[kBatch];  // the current batch (a token's first: cast before the routing barrier)
  for (int tok = t_begin; tok < t_end; ++tok) {
    const uint16_t* row = static_cast<const uint16_t*>(a.x) + static_cast<int64_t>(tok) * H;
    // One load_cast site (a second inlined copy was 14 % of the kernel, bench/NOTES.md session 34):
    // pass 0 casts the token's first batch before the routing barrier, then routes.
    int ndst = 0;  // the token's destinations (s_ndst after the routing barrier)
    for (int g0 = g_lo;; g0 += kBatch) {
      if (g0 < g_hi) load_cast<kFp4, kBatch>(a, row, g0, g_hi, lane, gscale, v, q, inv);
      if (g0 == g_lo) {  // every warp: the barrier inside
        // Warp 0 routes the token, lane k its selection k (was thread 0 alone, with the other warps
        // waiting: the largest part of a 1-token send, bench/LL_PROFILE.md section 2). Same result as
        // taking the selections in order k = 0, 1, ...: an expert's slot counts its earlier selections
        // (of this token: the lanes below with the same expert), a destination's list keeps k order,
        // and the destinations are the token's distinct ranks, ascending (the CPU backend's message
        // order), each at the index of how many of them are smaller.
        if (warp == 0) {
          const unsigned below = (1u << lane) - 1u;
          const int64_t j = static_cast<int64_t>(tok) * K + lane;
          const int64_t e = lane < K ? topk_at(a, j) : -1;
          const float w = lane < K && a.topk_weights != nullptr ? a.topk_weights[j] : 0.0f;
          if (tok == t_begin) LL_STAMP_AFTER(18, static_cast<uint32_t>(e));
          const bool in_range = e >= 0 && e < E;
          const int ei = in_range ? static_cast<int>(e) : 0, d = ei / El;
          const bool routed = in_range && !s_mask[d];  // not dropped (no expert, or a masked rank's)
          // Lanes routed to the same expert: a key no other lane has when not routed.
          const unsigned same_e = __match_any_sync(0xffffffffu, routed ? ei : -1 - lane);
          const int before = routed ? s_before[ei] : 0;
          const int slot = before + __popc(same_e & below);
          if (tok == t_begin) LL_STAMP_AFTER(15, slot);
          __syncwarp();
          if (routed && (same_e & below) == 0) s_before[ei] = before + __popc(same_e);  // the group's first lane
          // A message to every routed rank, even if every selection for it overflows.
          const RankList dst = rank_list(routed, d);
          const int idx = dst.idx;  // the destination index of rank d
          if (tok == t_begin) LL_STAMP_AFTER(16, idx);
          const bool first_d = dst.first;
          const bool kept = routed && slot < T;  // overflow: reported by the last block (one rank: block 0), the selection is dropped
          // One rank: every kept lane goes to rank 0 (a ballot, not a match).
          const unsigned same_d = kLocal ? __ballot_sync(0xffffffffu, kept) : __match_any_sync(0xffffffffu, kept ? d : -1 - lane);
          if (lane < kMaxLlTopk) s_n[lane] = 0;
          __syncwarp();
          if (kept) {
            const int pos = __popc(same_d & below);
            s_ent[idx][pos] = (static_cast<uint32_t>(ei % El) << 16) | static_cast<uint32_t>(slot);
            s_w[idx][pos] = w;
            if ((same_d & below) == 0) s_n[idx] = __popc(same_d);
          }
          if (first_d) {
            s_dst[idx] = d;
            s_msg[idx] = s_rc[d]++;
          }
          const unsigned far_firsts = __ballot_sync(0xffffffffu, first_d && remote<Net>(c, a, d));
          if (lane == 0) {
            s_ndst = dst.count;
            s_any_far = far_firsts != 0;
          }
          if (tok == t_begin) LL_STAMP_AFTER(17, far_firsts);
        }
        __syncthreads();
        if (tok == t_begin) LL_STAMP(11);
        ndst = s_ndst;
        // Warp i (taking turns): the meta of destination i's message and its index entries.
        for (int i = warp; i < ndst && warp < kDstWarps && slice == 0; i += kDstWarps) {  // one block per token
          const int d = s_dst[i], n = s_n[i];
          const bool seam = remote<Net>(c, a, d);  // staged: meta [d][slot], index rows [expert][slot]
          char* base = window(c, d);
          char* msg = seam ? local(c) + stage + a.stage_meta_off + static_cast<uint64_t>(d * T + s_msg[i]) * kMsgMeta
                           : base + msgs + static_cast<uint64_t>(c.rank * T + s_msg[i]) * a.msg_bytes;
          if (lane == 0) {
            *reinterpret_cast<int4*>(msg) = make_int4(tok, H, T, E);
            *reinterpret_cast<int4*>(msg + 16) = make_int4(n, a.topk_weights != nullptr, 0, 0);
          }
          if (lane < n) {
            const uint32_t en = s_ent[i][lane];
            reinterpret_cast<uint32_t*>(msg + 32)[lane] = en;
            reinterpret_cast<float*>(msg + 32 + 4 * kMaxLlTopk)[lane] = s_w[i][lane];
            if (kLocal) {
              a.src_info[static_cast<int64_t>(en >> 16) * T + (en & 0xffffu)] = tok;
            } else {
              const uint64_t w = (static_cast<uint64_t>((en >> 16) * R + c.rank) * T + (en & 0xffffu)) * 4;
              uint32_t* entry = seam ? at<uint32_t>(local(c), stage + a.stage_idx_off + (static_cast<uint64_t>(d * El + (en >> 16)) * T + (en & 0xffffu)) * 4)
                                     : at<uint32_t>(base, recv + a.idx_off + w);
              *entry = static_cast<uint32_t>(s_msg[i]);
            }
          }
        }
        if (tok == t_begin) LL_STAMP(12);
      }
      if (g0 >= g_hi) break;
      if constexpr (kLocal) {
        local_rows<kFp4, kBatch>(a, g0, g_hi, lane, ndst, s_n, s_ent, v, q, inv);
      } else {
        for (int i = -1; i < ndst; ++i) {  // i = -1: the staged payload of the remote destinations
          char* pay;
          if (i < 0) {
            if (!s_any_far) continue;
            pay = local(c) + stage + static_cast<uint64_t>(tok) * pay_stride;
          } else {
            const int d = s_dst[i];
            if (remote<Net>(c, a, d)) continue;
            pay = window(c, d) + msgs + static_cast<uint64_t>(c.rank * T + s_msg[i]) * a.msg_bytes + kMsgMeta;
          }
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            const int g = g0 + u;
            if (g >= g_hi) break;
            if (a.use_fp8) {
              *reinterpret_cast<uint32_t*>(pay + g * 128 + lane * 4) = q[u];
              if (lane == 0) *reinterpret_cast<float*>(pay + H + g * 4) = inv[u];
            } else if (kFp4) {  // H/2 bytes of codes, then H/16 scale bytes (the CPU backend's wire)
              *reinterpret_cast<uint16_t*>(pay + g * 64 + lane * 2) = static_cast<uint16_t>(q[u]);
              if (lane % 4 == 0) *reinterpret_cast<uint8_t*>(pay + H / 2 + g * 8 + lane / 4) = static_cast<uint8_t>(__float_as_uint(inv[u]));
            } else {
              *reinterpret_cast<uint2*>(pay + g * 256 + lane * 8) = v[u];
            }
          }
        }
      }
    }
    if (s_any_far) {  // warp i puts the staged meta and payload of remote destination i's message
      __syncthreads();
      for (int i = warp; i < ndst && warp < kDstWarps; i += kDstWarps) {
        const int d = s_dst[i];
        if (!remote<Net>(c, a, d)) continue;
        const uint64_t dst = msgs + static_cast<uint64_t>(c.rank * T + s_msg[i]) * a.msg_bytes;
        put_to<Net>(c, a, d, dst, stage + a.stage_meta_off + static_cast<uint64_t>(d * T + s_msg[i]) * kMsgMeta, kMsgMeta, lane);
        const uint64_t pay = a.use_fp8     ? (static_cast<uint64_t>(H) + H / 32 + 15) / 16 * 16
                             : kFp4        ? (static_cast<uint64_t>(H) / 2 + H / 16 + 15) / 16 * 16
                                           : 2 * static_cast<uint64_t>(H);
        put_to<Net>(c, a, d, dst + kMsgMeta, stage + static_cast<uint64_t>(tok) * pay_stride, pay, lane);
        put_any = true;
      }
    }
    __syncthreads();  // s_dst, s_n, s_ent, s_msg are rewritten for the next token
  }
  if (put_any) flush_net<Net>(c, a, lane);
  // kLocal: block 0 ran the tail after the counting pass (no peer waits for this call's stores,
  // and every block holds the whole count), so every block ends with its last token. A block that
  // reads the counter in begin_send after block 0 stored it gets another s_seq, which nothing in
  // the local form uses.
  if (kLocal) return true;
  // Every block fences its stores and counts itself done; the last one signals every count. One
  // fence per block, after the barrier: a fence is cumulative, so thread 0's orders every store
  // the barrier made it see (the grid-sync pattern) without 256 fences waiting on NVLink each.
  __syncthreads();
  LL_STAMP(2);
  if (tid == 0) {
    fence_acq_rel_sys();
    s_last = atomicAdd(at<unsigned int>(local(c), kLlDone), 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return true;
  LL_STAMP(3);
  if (has_seam<Net>(a)) {
    fence_acq_rel_sys();
    // Message counts (read by a partial combine) before the signals (remote: staged).
    for (int d = tid; d < R && tid < rank_workers(kSendThreads); d += rank_workers(kSendThreads)) {
      if (s_mask[d]) continue;
      const bool far = remote<Net>(c, a, d);
      char* cnt = far ? local(c) + stage + a.stage_cnt_off + 4 * d : window(c, d) + recv + 4 * c.rank;
      *reinterpret_cast<uint32_t*>(cnt) = static_cast<uint32_t>(s_rct[d]);
      if (!far) put_fmt(c, a, 0, d, fmt_dispatch(a));
    }
    // The seam's puts read the staged counts written above by other threads.
    fence_acq_rel_sys();
    __syncthreads();
  }
  for (int d = warp; has_seam<Net>(a) && d < R && warp < kDstWarps; d += kDstWarps) {  // warp per remote d: its count and index rows, then its signals
    if (!remote<Net>(c, a, d) || s_mask[d]) continue;
    put_to<Net>(c, a, d, recv + 4 * c.rank, stage + a.stage_cnt_off + 4 * d, 4, lane);
    for (int l = 0; l < El; ++l) {
      const int n = min(s_total[d * El + l], T);
      if (n > 0) {
        put_to<Net>(c, a, d, recv + a.idx_off + static_cast<uint64_t>(l * R + c.rank) * T * 4,
                    stage + a.stage_idx_off + static_cast<uint64_t>(d * El + l) * T * 4, 4 * static_cast<uint64_t>(n), lane);
      }
    }
    __syncwarp();
    for (int l = lane; l < El; l += 32) {
      raise_to<Net>(c, a, d, nullptr, kSeamDispatch, a.half, l, tag(s_seq, static_cast<uint32_t>(min(s_total[d * El + l], T))));
    }
    flush_net<Net>(c, a, lane);
  }
  // The NVLink signals: one fence per thread, after the barrier (cumulative over every store of
  // the block it made this thread see, and over the other blocks' stores that the ticket showed
  // thread 0), then relaxed system stores: the release pattern once per thread instead of a
  // release store (a fence of its own) per signal, which warp 0 ran twice in a row for E > 256
  // (bench/LL_PROFILE.md section 11).
  if (!kLocal && tid < E) fence_acq_rel_sys();
  const uint64_t sig = sig_off(a, a.half) + static_cast<uint64_t>(c.rank) * 4;
#pragma unroll 1
  for (int e = tid; e < E; e += kSendThreads) {
    const int d = e / El;
    if (s_mask[d]) continue;  // nothing goes to a masked rank
    const int cnt = s_total[e];
    if (cnt > T) report(c, DEK_IC_ERR_OVERFLOW, d, DEK_IC_SITE_LL_DISPATCH, cnt, T);
    if (kLocal || remote<Net>(c, a, d)) continue;  // no peer (local); signalled above (remote)
    st_relaxed_sys_u32(at<uint32_t>(window(c, d), sig + static_cast<uint64_t>((e % El) * R) * 4), tag(s_seq, static_cast<uint32_t>(min(cnt, T))));
  }
  __syncthreads();
  LL_STAMP(4);
  if (tid == 0) end_call(c, s_seq);
  return true;
}

// Instrument build: block 0 (the token's block at 1 token; the count block at one rank), the block
// that signalled (stamp 3 set) and, with `token_block`, the one-rank form's first and last token
// blocks (block 1, and the last block, which counts the most tokens) print their stamps every 16th
// call (bench/ll_stamps.py); d7 is the print's own time.
__device__ __forceinline__ void print_stamps(const Ctx& c, uint32_t seq, bool token_block = false) {
#ifdef DEEP_EP_LL_STAMPS
  __syncthreads();
  const unsigned long long* t = ll_stamps();
  if (threadIdx.x == 0 && (blockIdx.x == 0 || t[3] != 0 || (token_block && (blockIdx.x == 1 || blockIdx.x == gridDim.x - 1))) && seq % 16 == 0) {
    auto d = [&](int i) { return t[i] ? static_cast<long long>(t[i] - t[0]) : -1LL; };
    // The runtime writes a printf in pieces: give each rank its own stdout (bench/ll_stamps.py).
    printf("llst rank %d block %d seq %u t0 %llu d1 %lld d2 %lld d3 %lld d4 %lld d5 %lld d6 %lld d7 %lld d8 %lld d9 %lld d10 %lld d11 %lld "
           "d12 %lld d13 %lld d14 %lld d15 %lld d16 %lld d17 %lld d18 %lld\n",
           c.rank, blockIdx.x, seq, t[0], d(1), d(2), d(3), d(4), d(5), d(6), static_cast<long long>(globaltimer() - t[0]), d(8), d(9),
           d(10), d(11), d(12), d(13), d(14), d(15), d(16), d(17), d(18));
  }
#else
  (void)c, (void)seq, (void)token_block;
#endif
}

// ---- dispatch receive ---------------------------------------------------------------------------
// Column (l, y) of Y: waits for the R counts of local expert l (not for masked sources: count 0),
// then warps y*W+w (W warps per block), stepping by Y*W, copy the rows (sources ascending, then
// slot order): row (l, s, slot) is message idx[l][s][slot] of source s. Returns false when the
// block gives up (reported). Generic in the block size: the receive launch runs kLlThreads, the
// one-launch dispatch the send's kSendThreads. mask: the send's copy of the rank mask in this
// block (one load fewer before the wait), or NULL (read it; shrink mode: a wait may change it).
template <class Net, bool kFp4, int kThreads>
__device__ __forceinline__ bool dispatch_recv_column(const Ctx& c, const Args& a, int l, int y, int Y, int half, uint32_t seq,
                                                     const int* mask, DispatchColumnShared& sh) {
  constexpr int kWarps = kThreads / 32;
  int& s_ok = sh.ok;
  int(&s_cnt)[kMaxLlRanks] = sh.cnt;
  int(&s_begin)[kMaxLlRanks + 1] = sh.begin;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, T = a.num_max_tokens, H = a.hidden, S = H / 128;
  const int64_t RT = static_cast<int64_t>(R) * T;
  if (tid == 0) s_ok = 1;
  __syncthreads();
  char* me = local(c);
  constexpr int kWaiters = rank_workers(kThreads);  // threads waiting for sources, each for R / kWaiters
  for (int s = tid; s < R && tid < kWaiters; s += kWaiters) {
    const long long t0 = clock64();
    uint32_t v = 0;
    bool gave_up = false;
    const uint32_t* word = at<const uint32_t>(me, sig_off(a, half) + static_cast<uint64_t>(l * R + s) * 4);
    const bool dead = mask != nullptr ? mask[s] != 0 : rank_masked(a, s);
    const int got = dead ? 0 : wait_from<Net>(c, a, s, word, kSeamDispatch, half, l, seq, DEK_IC_SITE_LL_DISPATCH, &v, &gave_up);
    if (gave_up) abandon_call<Net>(c, a, kSeamDispatch, half, seq, a.shrink_mask != nullptr ? s : -1, false);
    if (got == 0) {
      s_cnt[s] = 0;  // a masked source (or, in shrink mode, one that timed out) counts as sending nothing
    } else if (got > 0) {
      s_cnt[s] = min(static_cast<int>(v & 0xffffu) - 1, T);
      if (l == 0 && y == 0 && !remote<Net>(c, a, s) && !fmt_agrees(c, a, 0, half, s, fmt_dispatch(a), DEK_IC_SITE_LL_DISPATCH)) s_ok = 0;
      if (y == 0 && a.wait_stats != nullptr) {
        atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + s), static_cast<unsigned long long>(clock64() - t0));
      }
    } else {
      s_ok = 0;
      break;  // reported; the block gives up
    }
  }
  __syncthreads();
  LL_STAMP(6);
  if (!s_ok) return false;
  if (tid == 0) {
    s_begin[0] = 0;
#pragma unroll 1  // these loops over ranks and experts run once or twice per thread: unrolled, they spread the code (NOTES s33)
    for (int s = 0; s < R; ++s) s_begin[s + 1] = s_begin[s] + s_cnt[s];
  }
  __syncthreads();
  const int total = s_begin[R];
  if (y == 0) {
#pragma unroll 1
    for (int s = tid; s < R; s += kThreads) a.layout_range[l * R + s] = (static_cast<int64_t>(s_begin[s]) << 32) | s_cnt[s];
    if (tid == 0) {
      a.recv_count[l] = total;
      if (a.cumulative != nullptr) a.cumulative[l] += total;
    }
  }
  const uint64_t recv = recv_off(a, half);
  const int64_t xrow_bytes = a.use_fp8 ? H : kFp4 ? H / 2 : 2 * static_cast<int64_t>(H);
  for (int i = y * kWarps + warp; i < total; i += Y * kWarps) {
    int s = 0;  // the first source whose rows reach past i (binary search over the prefix)
#pragma unroll 1
    for (int hi = R - 1; s < hi;) {
      const int mid = (s + hi) / 2;
      if (s_begin[mid + 1] > i) {
        hi = mid;
      } else {
        s = mid + 1;
      }
    }
    const int slot = i - s_begin[s];
    const uint32_t m = __ldcg(reinterpret_cast<const unsigned int*>(me + recv + a.idx_off) + (static_cast<uint64_t>(l * R + s) * T + slot));
    if (m >= static_cast<uint32_t>(T)) {
      if (lane == 0) report(c, DEK_IC_ERR_MISMATCH, s, DEK_IC_SITE_LL_DISPATCH, static_cast<int>(m), T);
      continue;
    }
    const char* msg = me + recv + a.msgs_off + (static_cast<uint64_t>(s) * T + m) * a.msg_bytes;
    // The header and the row's first loads go out together (both addresses depend on m only): one
    // memory latency per row less in the chain (bench/LL_PROFILE.md section 11). A header of
    // another geometry is reported after its row was copied into the row's own place in recv_x:
    // a raising call's outputs are unspecified, and nothing outside them is written. (A row's
    // scales all loaded ahead made the kernel spill; each lane's first ones, below, do not.)
    const int4 hdr = __ldcg(reinterpret_cast<const int4*>(msg));
    const float* si = reinterpret_cast<const float*>(msg + kMsgMeta + H);
    // An FP8 row's first scales per lane go out with the header too (after the copy, its stores
    // kept them one latency behind): float scales g = lane, lane + 32; UE8M0 pack p = lane's four.
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
    if (!kFp4 && a.use_fp8) {
      if (a.use_ue8m0) {
        if (lane < S / 4) {
#pragma unroll
          for (int b = 0; b < 4; ++b) sc[b] = __ldcg(si + 4 * lane + b);
        }
      } else {
        if (lane < S) sc[0] = __ldcg(si + lane);
        if (lane + 32 < S) sc[1] = __ldcg(si + lane + 32);
      }
    }
    const int64_t row = l * RT + i;
    warp_copy(static_cast<char*>(a.recv_x) + row * xrow_bytes, msg + kMsgMeta, xrow_bytes, lane);
    if (hdr.y != H || hdr.z != T || hdr.w != a.num_experts) {
      if (lane == 0) report(c, DEK_IC_ERR_MISMATCH, s, DEK_IC_SITE_LL_DISPATCH, hdr.y, H);
      continue;
    }
    if (lane == 0) a.src_info[row] = hdr.x;
    if (kFp4) {  // scale j of row i at its place in the expert's 128x4 swizzle (nvfp4::scale_offset)
      const unsigned char* sb = reinterpret_cast<const unsigned char*>(msg + kMsgMeta + H / 2);
      const int rk = H / 64;
      unsigned char* dst = static_cast<unsigned char*>(a.recv_scales) + static_cast<int64_t>(l) * ((RT + 127) / 128) * rk * 512 +
                           static_cast<int64_t>(i / 128) * rk * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4;
      for (int j = lane; j < H / 16; j += 32) dst[(j / 4) * 512 + j % 4] = __ldcg(sb + j);
      continue;
    }
    if (!a.use_fp8) continue;
    const int64_t sbase = l * a.scale_stride[0] + i * a.scale_stride[1];
    if (a.use_ue8m0) {
      for (int p = lane; p < S / 4; p += 32) {
        uint32_t pack = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) pack |= ((__float_as_uint(p == lane ? sc[b] : __ldcg(si + 4 * p + b)) >> 23) & 0xffu) << (8 * b);
        static_cast<int32_t*>(a.recv_scales)[sbase + p * a.scale_stride[2]] = static_cast<int32_t>(pack);
      }
    } else {
      for (int g = lane; g < S; g += 32) {
        const float v = g == lane ? sc[0] : g == lane + 32 ? sc[1] : __ldcg(si + g);
        static_cast<float*>(a.recv_scales)[sbase + g * a.scale_stride[2]] = v;
      }
    }
  }
  __syncthreads();  // s_cnt, s_begin and s_ok are rewritten by the block's next column
  return true;
}

// The receive launch: block (l, y) of grid (E_l, Y) is column (l, y), the call's half and number
// from recv_state (written by the send launch).
template <class Net, bool kFp4>
__device__ __forceinline__ void dispatch_recv(const Ctx& c, const Args& a, DispatchRecvShared& sh, DispatchColumnShared& column) {
  int &s_ok = sh.ok, &s_half = sh.half;
  int(&s_mask)[kMaxLlRanks] = sh.mask;
  uint32_t& s_seq = sh.seq;
  // Warps 1.. read the rank mask while thread 0 reads recv_state (on thread 0 the two were two
  // latencies in a chain); shrink mode reads it at each wait instead (a wait may change it).
  for (int r = static_cast<int>(threadIdx.x) - 32; r >= 0 && r < c.num_ranks; r += kLlThreads - 32) s_mask[r] = rank_masked(a, r);
  if (threadIdx.x == 0) {
    int h = 0, fl = 0;
    uint32_t q = 0;
    s_ok = read_state(c, a, DEK_LL_KIND_DISPATCH, true, DEK_IC_SITE_LL_DISPATCH, &h, &q, &fl);
    s_half = h;
    s_seq = q;
  }
  __syncthreads();
  if (s_ok) dispatch_recv_column<Net, kFp4, kLlThreads>(c, a, blockIdx.x, blockIdx.y, gridDim.y, s_half, s_seq, a.shrink_mask != nullptr ? nullptr : s_mask, column);
}

}  // namespace

// ---- the kernel ------------------------------------------------------------------------------
// One kernel for both halves, the half chosen by `phase` (as DeepEP's): profilers and benchmarks
// find exactly one `dispatch` (docs/OPS.md, "Kernel names"). Send: kSendThreads per block; receive:
// kLlThreads. DEK_LL_PHASE_BOTH (no hook; over NvlNet): every block sends its tokens, then receives
// columns b, b + G, ... of the E_l x Y columns with its kSendThreads, the call's half and number its
// own (no recv_state), for a grid resident at once (the launcher's caller's condition).
// kFp4: the NVFP4 payload (a.use_nvfp4), its own instantiation (registers 128 -> 148 in one kernel).
// kLocal (one rank, dek_ll_dispatch_local): the send writes the outputs, no receive. kSplit (NVLink
// one launch, FP8 / NVFP4, few tokens): a token's groups over peer_split blocks.
// 2 blocks per SM in the bound for every form: the one-rank split grid (<= 264 blocks) is one wave.
template <class Net, bool kFp4, bool kLocal = false, bool kSplit = false>
__global__ void __launch_bounds__(kSendThreads, 2) dispatch(const __grid_constant__ Ctx c, const __grid_constant__ Args a, int phase) {
  pdl_wait();  // one-launch forms: launched early (launch_pdl); wait for the kernel before, let the next one launch
  pdl_trigger();
  __shared__ DispatchShared sh;
  if (!kLocal && phase == DEK_LL_PHASE_RECV) {
    dispatch_recv<Net, kFp4>(c, a, sh.recv, sh.column);
    return;
  }
  uint32_t seq = 0;
#ifdef DEEP_EP_LL_STAMPS
  if (threadIdx.x == 0) {
    for (int i = 0; i < kLlStamps; ++i) ll_stamps()[i] = 0;
  }
  LL_STAMP(0);
#endif
  const int* mask = nullptr;
  const bool sent = dispatch_send<Net, kFp4, kLocal, kSplit>(c, a, &seq, &mask, sh.send);
  if (kLocal && sent) print_stamps(c, seq, true);  // the one-rank form ends at its send (blocks 0, 1, last print; no d2-d6)
  if (!sent || kLocal || phase != DEK_LL_PHASE_BOTH) return;
  if (a.shrink_mask != nullptr) mask = nullptr;  // a wait may mask a rank during the call: read it each time
  LL_STAMP(5);
  const int el = a.num_experts / c.num_ranks, blocks = static_cast<int>(gridDim.x), y_count = blocks > el ? blocks / el : 1;
  for (int col = blockIdx.x; col < el * y_count; col += blocks) {
    if (!dispatch_recv_column<Net, kFp4, kSendThreads>(c, a, col % el, col / el, y_count, a.half, seq, mask, sh.column)) return;
  }
  print_stamps(c, seq);
}

// `dispatch` over Net with the NVFP4 payload or not (not the one-rank or the split form).
template <class Net>
auto dispatch_for(bool fp4) { return fp4 ? dispatch<Net, true> : dispatch<Net, false>; }

// Blocks per token of the split NVLink send (kSplit) of `args` over at most `blocks` (the kernel's
// own peer_split on the same grid): a cast payload (FP8 / NVFP4) of few tokens; 1: not split.
int split_of(const dek_ll_args_t* args, int blocks) {
  return args->use_nvfp4 || args->use_fp8 ? peer_split(args->num_tokens, std::min(blocks, 64), args->hidden / 128) : 1;
}

// `dispatch` for the Net and payload of `args`.
int launch_dispatch(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, dim3 grid, int threads, void* stream, int phase) {
  const bool gin = args->net != nullptr && args->net_kind == DEK_LL_NET_GIN, fp4 = args->use_nvfp4 != 0;
  const cudaStream_t s = as_stream(stream);
  auto* const split = fp4 ? dispatch<NvlNet, true, false, true> : dispatch<NvlNet, false, false, true>;
  if (!gin && phase == DEK_LL_PHASE_BOTH) {  // one launch over NVLink: early, as the one-rank form
    auto* k = split_of(args, static_cast<int>(grid.x)) > 1 ? split : dispatch_for<NvlNet>(fp4);
    return launch_pdl(k, static_cast<int>(grid.x), threads, s, *ctx, *args, phase);
  }
  // Two launches (hook): with no seam the one-launch form's kernels (no seam code), the split send
  // on N * P blocks (every block has a slice).
  auto* k = gin ? dispatch_for<GinNet>(fp4) : args->net == nullptr ? dispatch_for<NvlNet>(fp4) : dispatch_for<LsaNet>(fp4);
  const int p = args->net == nullptr && phase == DEK_LL_PHASE_SEND ? split_of(args, args->num_blocks) : 1;
  if (p > 1) {
    k = split;
    grid = dim3(args->num_tokens * p);
  }
  k<<<grid, threads, 0, s>>>(*ctx, *args, phase);
  return static_cast<int>(cudaGetLastError());
}
}  // namespace ll
}  // namespace deep_ep

using namespace deep_ep::ll;

namespace {
// The send's arguments (recv_state: written for the receive launch; the one-launch call has none).
bool send_args_ok(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, bool need_state) {
  return ll_ok(ctx, args) && (args->recv_state != nullptr || !need_state) &&
         (args->num_tokens == 0 || (args->x != nullptr && args->topk_idx != nullptr)) && args->num_experts <= kMaxLlExperts &&
         args->num_topk <= kMaxLlTopk && (!args->use_nvfp4 || (!args->use_fp8 && args->x_global_scale != nullptr));
}
// Send blocks of one or a few tokens (at most num_blocks, all resident), at least one.
int token_blocks(const dek_ll_args_t* args) {
  return args->num_tokens < 1 ? 1 : (args->num_tokens < args->num_blocks ? args->num_tokens : args->num_blocks);
}
// The receive's outputs.
bool recv_args_ok(const dek_ll_args_t* args) {
  return args->recv_x != nullptr && args->recv_count != nullptr && args->src_info != nullptr && args->layout_range != nullptr &&
         ((!args->use_fp8 && !args->use_nvfp4) || args->recv_scales != nullptr);
}
}  // namespace

extern "C" int dek_ll_dispatch_send(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (!send_args_ok(ctx, args, true)) return static_cast<int>(cudaErrorInvalidValue);
  // All resident (8 per SM by threads); at least one signals.
  return launch_dispatch(ctx, args, dim3(token_blocks(args)), kSendThreads, stream, DEK_LL_PHASE_SEND);
}

extern "C" int dek_ll_dispatch_recv(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args) || args->recv_state == nullptr || !recv_args_ok(args)) return static_cast<int>(cudaErrorInvalidValue);
  const int el = args->num_experts / ctx->num_ranks;
  // At most num_blocks blocks (rounded down to whole columns): they are sized to be resident at
  // once, and one block more than fits costs a second wave (288 x 2 = 576 > 528 on 132 SMs).
  const int y = args->num_blocks > el ? args->num_blocks / el : 1;
  return launch_dispatch(ctx, args, dim3(el, y), kLlThreads, stream, DEK_LL_PHASE_RECV);
}

extern "C" int dek_ll_dispatch(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (!send_args_ok(ctx, args, false) || !recv_args_ok(args) || args->net != nullptr) return static_cast<int>(cudaErrorInvalidValue);  // NvlNet
  // num_blocks blocks of kSendThreads, every one resident at once (the caller's send grid).
  return launch_dispatch(ctx, args, dim3(args->num_blocks < 1 ? 1 : args->num_blocks), kSendThreads, stream, DEK_LL_PHASE_BOTH);
}

extern "C" int dek_ll_dispatch_local(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (ctx == nullptr || ctx->num_ranks != 1 || args == nullptr || args->net != nullptr || !send_args_ok(ctx, args, false) || !recv_args_ok(args))
    return static_cast<int>(cudaErrorInvalidValue);
  // A token's groups over P blocks while the send grid has room (P = 8 at 1 token and hidden 7168:
  // one group per payload warp; bench/NOTES.md session 26): a token's cast and stores were one block's.
  // Block 0 is the count block (no token): the token blocks fill the rest of the send grid, so
  // that the whole grid fits in one wave.
  const int n = args->num_tokens, groups = args->hidden / 128, room = std::max(1, args->num_blocks - 1);
  const int p = n >= 1 ? std::min(room / n, groups / kPayWarps) : 1;
  const int blocks = 1 + (p > 1 ? n * p : std::max(1, std::min(n, room)));
  auto* kernel = args->use_nvfp4 ? dispatch<NvlNet, true, true> : dispatch<NvlNet, false, true>;
  return launch_pdl(kernel, blocks, kSendThreads, deep_ep::as_stream(stream), *ctx, *args, static_cast<int>(DEK_LL_PHASE_BOTH));
}
