// intranode_check.cuh: device-side checks of the routing inputs of the intranode normal-mode ops
// (dek_ic_check in deep_ep_kernels.h), run by the check kernel (intranode_check.cu) and folded into
// the stage kernel (intranode_sync.cu, dek_ic_stage_args_t::run_check): the content checks the cpu backend makes on the host,
// here without a host sync. The result travels in this rank's header (the slot of the next barrier)
// to the barrier that gathers it (the data barrier; for the fused combine, the start barrier),
// which raises it on every rank and cancels the op (intranode_sync.cu).
//
// Three phases over the caller's grid, then the last block to finish decides:
//  A  one thread per token: expert ids in range, is_token_in_rank row == the ranks of the valid ids
//     (every id's rank selected, and as many ranks selected as the ids have distinct ranks: no
//     per-rank bitmask, so any R up to DEK_IN_MAX_RANKS), and a sum of 64-bit hashes of the valid ids (minus sum over e of ntpe[e] * hash(e): zero iff
//     num_tokens_per_expert matches, up to a 2^-64 chance);
//  B  one warp per (destination d, channel): counts is_token_in_rank[:, d] over the channel's
//     tokens (added to the per-rank counts at DEK_IC_CHECK_COUNTS_OFF) and, for a handle, compares send_head and channel_prefix_matrix
//     with what crate::layout::send_side gives for is_token_in_rank;
//  C  the last block compares the per-rank counts (num_tokens_per_rank or rank_prefix_matrix),
//     writes the first failure (in the cpu backend's order) into the header and zeroes the scratch.
#pragma once

#include <cstdint>

#include "intranode.cuh"

namespace deep_ep {
namespace ic {
namespace {

constexpr int kCheckThreads = 256;
constexpr int kCheckUnroll = 4;  // phase B: 32-token rows loaded ahead per step

// Check scratch (kScrCheck, 128 bytes, and the counts [R] at DEK_IC_CHECK_COUNTS_OFF of the rank
// tables; zero between launches).
struct CheckScratch {
  unsigned long long hash;  // sum of hash(valid id) - sum of ntpe[e] * hash(e)
  unsigned int ticket;      // blocks finished
  unsigned int flags;       // kBad* bits
  long long bad_id;         // first bad expert id found
  int bad_in_rank;          // 1 + token whose is_token_in_rank row differs
  int bad_in_rank_d;
  int bad_send_head;        // 1 + token whose send_head differs
  int bad_send_head_d;
  int bad_cpm;              // 1 + d * C + channel whose channel_prefix_matrix entry differs
};
static_assert(sizeof(CheckScratch) <= 128, "check scratch larger than its slot");

constexpr unsigned kBadId = 1, kBadInRank = 2, kBadSendHead = 4, kBadCpm = 8;

__device__ __forceinline__ unsigned long long id_hash(long long e) {  // splitmix64
  unsigned long long z = static_cast<unsigned long long>(e) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ int clamp32(long long v) {
  return static_cast<int>(max(min(v, static_cast<long long>(INT32_MAX)), static_cast<long long>(INT32_MIN)));
}

// Expert id j of token t.
__device__ __forceinline__ long long id_at(const dek_ic_check_args_t& a, int64_t t, int64_t j) {
  const int64_t i = t * a.num_topk + j;
  return a.topk_is_int64 ? static_cast<const int64_t*>(a.topk_idx)[i] : static_cast<const int32_t*>(a.topk_idx)[i];
}

// Whether one of token t's valid ids (in [0, E)) is an expert of rank d.
__device__ __forceinline__ bool ids_reach(const dek_ic_check_args_t& a, int64_t t, int64_t el, int64_t d) {
  for (int64_t j = 0; j < a.num_topk; ++j) {
    const long long e = id_at(a, t, j);
    if (e >= 0 && e < a.num_experts && e / el == d) return true;
  }
  return false;
}

// Phase C, by thread 0 of the grid's last block: the per-rank counts, then the first failure in
// the cpu backend's order, into the header slot of the next barrier; the scratch zeroed.
__device__ __noinline__ void check_verdict(const Ctx& c, const dek_ic_check_args_t& a, CheckScratch* scr, int* cnt) {
  const int R = c.num_ranks;
  const int64_t E = a.num_experts, C = a.num_channels;
  __threadfence();
  volatile CheckScratch* v = scr;
  const volatile int* vcnt = cnt;
  const unsigned flags = v->flags;
  int code = 0, value = 0, limit = 0, extra = 0;
  const int* rpm = a.rank_prefix_matrix;
  for (int d = 0; d < R && code == 0; ++d) {
    const int got = vcnt[d];
    if (rpm == nullptr && a.num_tokens_per_rank != nullptr && a.num_tokens_per_rank[d] != got) {
      code = DEK_IC_ERR_NTPR, value = a.num_tokens_per_rank[d], limit = got, extra = d;
    } else if (rpm != nullptr) {
      const int want = rpm[c.rank * R + d] - (c.rank > 0 ? rpm[(c.rank - 1) * R + d] : 0);
      if (want != got) code = DEK_IC_ERR_STALE_COUNTS, value = got, limit = want, extra = d;
    }
  }
  if (code == 0 && (flags & kBadId)) {
    code = DEK_IC_ERR_EXPERT_ID, value = clamp32(v->bad_id), limit = clamp32(E);
  } else if (code == 0 && a.topk_idx != nullptr && a.num_tokens_per_expert != nullptr && v->hash != 0) {
    code = DEK_IC_ERR_NTPE;
  } else if (code == 0 && (flags & kBadInRank)) {
    code = DEK_IC_ERR_IN_RANK, value = v->bad_in_rank - 1, extra = v->bad_in_rank_d;
  } else if (code == 0 && rpm != nullptr && rpm[(R - 1) * R + c.rank] > a.num_rows) {
    code = DEK_IC_ERR_STALE_ROWS, value = rpm[(R - 1) * R + c.rank], limit = clamp32(a.num_rows);
  } else if (code == 0 && (flags & kBadSendHead)) {
    code = DEK_IC_ERR_STALE_SEND_HEAD, value = v->bad_send_head - 1, extra = v->bad_send_head_d;
  } else if (code == 0 && (flags & kBadCpm)) {
    const int i = v->bad_cpm - 1;
    code = DEK_IC_ERR_STALE_CPM, value = static_cast<int>(i % C), extra = static_cast<int>(i / C);
  }
  // Into the header slot of the next barrier: the one that gathers this op's header (the data
  // barrier, or the fused combine's start barrier, whose publish keeps these words).
  int* out = at<int>(local(c), next_header_slot(c) + DEK_IC_CHECK_OFF);
  out[0] = code, out[1] = value, out[2] = limit, out[3] = extra;
  // Ready for the next op (stream-ordered after this kernel).
  unsigned long long* words = reinterpret_cast<unsigned long long*>(scr);
  for (int i = 0; i < 16; ++i) words[i] = 0;
  for (int d = 0; d < R; ++d) cnt[d] = 0;
}

// The checks of dek_ic_check with the grid and block of whatever kernel calls it (every block of
// the grid must call it once, as its last work: the grid's last block to finish writes the result).
// Internal and inlined into each caller, so it takes that kernel's register budget.
__device__ __forceinline__ bool run_checks(const Ctx& c, const dek_ic_check_args_t& a) {
  __shared__ unsigned long long s_hash;
  __shared__ int s_cnt[DEK_IN_MAX_RANKS];
  CheckScratch* scr = at<CheckScratch>(local(c), kScrCheck);
  int* cnt = at<int>(local(c), DEK_IC_CHECK_COUNTS_OFF);  // is_token_in_rank column counts [R]
  const int R = c.num_ranks, lane = threadIdx.x & 31;
  const int64_t n = a.num_tokens, k = a.num_topk, E = a.num_experts, C = a.num_channels;
  if (threadIdx.x == 0) s_hash = 0;
  for (int d = threadIdx.x; d < R; d += blockDim.x) s_cnt[d] = 0;
  __syncthreads();
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const unsigned char* in_rank = reinterpret_cast<const unsigned char*>(a.is_token_in_rank);

  // ---- A: per token (dispatch with top-k) ----
  if (a.topk_idx != nullptr) {
    const int64_t el = E / R;
    unsigned long long h = 0;
    for (int64_t t = tid; t < n; t += threads) {
      // The row equals the ranks of the valid ids iff every such rank is selected in it and it
      // selects as many ranks as the ids have distinct ones.
      int selected = 0, distinct = 0;
      bool covered = true;
      for (int d = 0; d < R; ++d) selected += in_rank[t * R + d] != 0;
      // The ids in groups of kCheckUnroll, loaded before use (the atomics below would otherwise
      // keep the loads in order, one latency each).
      for (int64_t j0 = 0; j0 < k; j0 += kCheckUnroll) {
        long long ids[kCheckUnroll];
#pragma unroll
        for (int u = 0; u < kCheckUnroll; ++u) ids[u] = j0 + u >= k ? -1 : id_at(a, t, j0 + u);
        // Each valid id's is_token_in_rank entry, all in flight before any is used.
        unsigned reached = 0;  // bit u: id u is invalid or its rank is selected
#pragma unroll
        for (int u = 0; u < kCheckUnroll; ++u) reached |= (ids[u] < 0 || ids[u] >= E || in_rank[t * R + ids[u] / el] != 0) << u;
#pragma unroll
        for (int u = 0; u < kCheckUnroll; ++u) {
          const long long e = ids[u];
          if (e < -1 || e >= E) {
            atomicOr(&scr->flags, kBadId);
            atomicCAS(reinterpret_cast<unsigned long long*>(&scr->bad_id), 0ull, static_cast<unsigned long long>(e));
          } else if (e >= 0) {
            h += id_hash(e);
            const int64_t d = e / el;
            covered = covered && ((reached >> u) & 1u);
            bool first = true;  // no earlier valid id of the token has this rank
            for (int64_t j = 0; j < j0 + u && first; ++j) {
              const long long f = id_at(a, t, j);
              first = !(f >= 0 && f < E && f / el == d);
            }
            distinct += first;
          }
        }
      }
      if (!covered || selected != distinct) {
        for (int d = 0; d < R; ++d) {  // the first rank that differs, as the cpu backend reports it
          if ((in_rank[t * R + d] != 0) != ids_reach(a, t, el, d)) {
            atomicOr(&scr->flags, kBadInRank);
            if (atomicCAS(&scr->bad_in_rank, 0, static_cast<int>(t) + 1) == 0) scr->bad_in_rank_d = d;
            break;
          }
        }
      }
    }
    if (a.num_tokens_per_expert != nullptr) {
      for (int64_t e = tid; e < E; e += threads) h -= static_cast<unsigned long long>(a.num_tokens_per_expert[e]) * id_hash(e);
    }
    // One shared atomic per warp, not per thread (512 on one address).
    for (int o = 16; o > 0; o >>= 1) h += __shfl_xor_sync(0xffffffffu, h, o);
    if (lane == 0) atomicAdd(&s_hash, h);
  }

  // ---- B: per (destination, channel) ----
  const int64_t per = tokens_per_channel(n, C);
  const int64_t warps = threads >> 5;
  // From the grid's last warp down: the warps past the tokens of phase A walk the channels beside it.
  for (int64_t pair = warps - 1 - (tid >> 5); pair < R * C; pair += warps) {
    const int d = static_cast<int>(pair / C);
    const int64_t ch = pair % C;
    const int64_t start = min(per * ch, n), end = min(start + per, n);
    int running = 0;
    // kCheckUnroll rows of 32 tokens per step, their loads issued before any is used: the walk over
    // a channel is a chain of load latencies, so fewer, wider steps shorten it.
    for (int64_t base = start; base < end; base += 32 * kCheckUnroll) {
      bool in[kCheckUnroll];
      int head[kCheckUnroll];
#pragma unroll
      for (int u = 0; u < kCheckUnroll; ++u) {
        const int64_t t = base + u * 32 + lane;
        in[u] = t < end && in_rank[t * R + d] != 0;
        head[u] = a.send_head != nullptr && t < end ? a.send_head[t * R + d] : 0;
      }
#pragma unroll
      for (int u = 0; u < kCheckUnroll; ++u) {
        const int64_t t = base + u * 32 + lane;
        const unsigned m = __ballot_sync(0xffffffffu, in[u]);
        if (a.send_head != nullptr && t < end) {
          const int want = in[u] ? running + __popc(m & ((1u << lane) - 1u)) : -1;
          if (head[u] != want) {
            atomicOr(&scr->flags, kBadSendHead);
            if (atomicCAS(&scr->bad_send_head, 0, static_cast<int>(t) + 1) == 0) scr->bad_send_head_d = d;
          }
        }
        running += __popc(m);
      }
    }
    if (lane == 0) {
      atomicAdd(&s_cnt[d], running);
      if (a.channel_prefix_matrix != nullptr) {
        const int* cpm = a.channel_prefix_matrix + d * C;
        if (cpm[ch] - (ch > 0 ? cpm[ch - 1] : 0) != running) {
          atomicOr(&scr->flags, kBadCpm);
          atomicCAS(&scr->bad_cpm, 0, static_cast<int>(d * C + ch) + 1);
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(&scr->hash, s_hash);
  for (int d = threadIdx.x; d < R; d += blockDim.x) atomicAdd(&cnt[d], s_cnt[d]);
  if (!last_block(&scr->ticket, false)) return false;  // check_verdict zeroes the scratch, the ticket too
  if (threadIdx.x == 0) check_verdict(c, a, scr, cnt);
  __syncthreads();  // the verdict before whatever the last block does next (check_sync: the barrier)
  return true;
}

}  // namespace
}  // namespace ic
}  // namespace deep_ep
