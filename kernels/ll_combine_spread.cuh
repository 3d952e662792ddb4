// ll_combine_spread.cuh: the per-expert (rows) send with its rows spread evenly over every warp of
// the grid (spread_rows): the one-launch LL combine's BF16 rows (combine_send_rows_spread) and the
// two-launch LogFMT send from kLogfmtSpreadFrom selections (low_latency.cu). The per-item send
// (combine_send_rows) gives each (expert, source) item one block, so the heaviest expert's block
// sets the send's time (bench/LL_PROFILE.md 11.6: ~10 rows x 7 chunks on 4 warps, 15 of the 31.8
// us at 128 tokens on one rank). Here the grid's warps split the (row, chunk) units of all items
// in item order, and per-item completion counters say which warp finished an item: that warp
// signals it. Also the selection count where the one-launch rows forms change
// (kSpreadMinSelections) and own_rows.
#pragma once

#include <cstdint>

#include "low_latency.cuh"

namespace deep_ep {
namespace ll {
namespace {

// The one-launch rows combine with its send spread over every warp: the launcher's choice from
// kSpreadMinSelections top-k selections of this rank's tokens on (one rank only). Below, the scan
// and the completion counters cost more than the heaviest expert's block (bench/NOTES.md, session
// 24, one rank: +3 us at 1-32 tokens, +1.5 at 64, -1.5 at 96, -6 at 128). From there on, the
// kOwn rows kernel reads this rank's own rows in place (own_rows) and runs a wider grid.
constexpr int64_t kSpreadMinSelections = 768;

// The one-launch rows combine reads this rank's own rows where they are (x, or the zero-copy slot)
// instead of copying them into its own receive half: the send leaves each own row's index
// (l*R*T + row, int64) at the row's place, the receive resolves it (combine_recv_tokens, kOwn).
// A zero-copy slot row is 2H + 4H/128 bytes: 16-byte aligned for the int4 loads when H % 512 == 0.
__host__ __device__ __forceinline__ bool own_rows_direct(const Args& a) { return !a.zero_copy || a.hidden % 512 == 0; }
// Where the rows-only one-launch kernel (kOwn) reads the own rows in place: from
// kSpreadMinSelections selections on (below, the index load per own selection cost 0.4-0.5 µs at
// 2 ranks, bench/NOTES.md session 31). Send and receive (the same rank) decide alike.
__device__ __forceinline__ bool own_rows(const Args& a) {
  return own_rows_direct(a) && ll_selections(a) >= kSpreadMinSelections;
}

// Local scratch of the control area: u32 [DEK_LL_MAX_EXPERTS] units done per item (l*R + s) of the
// current call, back to 0 once the item is signalled (zeroed with the window at creation).
constexpr size_t kLlItemDone = (DEK_IC_RANK_TABLES_END + 127) / 128 * 128;
static_assert(kLlItemDone + 4 * static_cast<size_t>(kMaxLlExperts) <= DEK_GB_OFF, "item counters overlap the barrier area");
// Warps per block of a spread send at most (its blocks: kLlThreads, or kLogfmtSendThreads).
constexpr int kMaxSpreadWarps = kReduceThreads / 32;

// The last i with pre[i] <= r (pre ascending, pre[0] = 0 <= r): the non-empty item holding row r.
__device__ __forceinline__ int spread_find(const int* pre, int n, int64_t r) {
  int lo = 0, hi = n;  // pre[lo] <= r < pre[hi] (pre[n] = every row > r)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (pre[mid] <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The rows of every item of a per-expert combine send spread evenly over the grid's warps (1-D
// grid; no hook overlap, no seam: NVLink stores only). Units are (row, `unit` channels) of the
// items in order i = l*R + s; global warp w takes units [U*w/W, U*(w+1)/W). `body(l, s, row, tok,
// c0, c1)` sends channels [c0, c1) of row `row` of local expert l (source token tok, valid) to
// rank s: a run of the row's consecutive units (a row's units are contiguous: more in flight than
// one unit at a time). After its units a warp adds, per item it touched (one lane each, after a
// fence: cumulative over the warp's stores, the grid-sync pattern), its units to the item's
// counter; the lane whose add completes an item fences again and signals word rank*E_l + l on
// source s (tag(seq, 0)), after the format words (fmt_combine(logfmt, false)) for l = 0. An item
// with no rows is signalled at once by one thread of the grid. Same bytes at the same places and
// the same signals as the per-item sends (combine_send_rows, ll_combine_send_logfmt).
// kMaxItems: the most items (E) the scan holds; the launcher keeps E within it (the one-launch
// LogFMT kernel's 512: its static shared memory has room for no more, kOneLaunchSpreadItems).
// kTag: callers that different kernels inline pass different tags, so that the scan's function-scope
// arrays are a symbol of their own in each (one symbol shared by several kernels is placed past all
// of their variables by the device link: bench/NOTES.md session 48).
template <class Net, int kMaxItems = kMaxLlExperts, int kTag = 0, class Body>
__device__ __forceinline__ void spread_rows(const Ctx& c, const Args& a, uint32_t seq, int unit, bool logfmt, Body body) {
  __shared__ int s_pre[kMaxItems + 1];  // rows of the items before item i
  __shared__ int s_warp[kMaxSpreadWarps];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, nw = static_cast<int>(blockDim.x / 32);
  const int R = c.num_ranks, E = a.num_experts, El = E / R, T = a.num_max_tokens, H = a.hidden;
  const int64_t RT = static_cast<int64_t>(R) * T;
  const int nchunks = (H + unit - 1) / unit;
  const uint32_t fmt = fmt_combine(logfmt, false);
  // Thread tid < kLlThreads owns items [i0, i1), its loads issued together (one memory latency: a
  // chain of them per item cost ~5 us at one token, session 24). Rows of item i = l*R + s to send:
  // 0 for a masked source, or for a range no dispatch of this geometry makes (the host checks shapes).
  constexpr int kPer = (kMaxItems + kLlThreads - 1) / kLlThreads;
  const int per = (E + kLlThreads - 1) / kLlThreads, i0 = min(E, tid * per), i1 = min(E, i0 + per);
  int mine = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = i0 + j;
    if (i < i1) {
      const int64_t lr = __ldg(a.layout_range + i), b = lr >> 32, cnt = lr & 0xffffffffLL;
      const int n = b < 0 || cnt > T || b + cnt > RT || rank_masked(a, i % R) ? 0 : static_cast<int>(cnt);
      s_pre[i + 1] = n;
      mine += n;
    }
  }
  int incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int run = incl - mine;
  for (int w = 0; w < warp; ++w) run += s_warp[w];
  if (tid == 0) s_pre[0] = 0;
  for (int i = i0; i < i1; ++i) s_pre[i + 1] = run += s_pre[i + 1];
  __syncthreads();
  // Items without rows: signalled now (nothing of theirs to order before the word but the format
  // words, which the release store orders).
  for (int i = blockIdx.x * blockDim.x + tid; i < E; i += gridDim.x * blockDim.x) {
    const int l = i / R, s = i % R;
    if (s_pre[i + 1] != s_pre[i] || rank_masked(a, s)) continue;
    if (l == 0) put_fmt(c, a, 1, s, fmt);
    raise_to<Net>(c, a, s, at<uint32_t>(window(c, s), sig_off(a, a.half) + static_cast<uint64_t>(c.rank * El + l) * 4), kSeamCombine,
                     a.half, l, tag(seq, 0));
  }
  const int64_t U = static_cast<int64_t>(s_pre[E]) * nchunks, W = static_cast<int64_t>(gridDim.x) * nw;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * nw + warp;
  const int64_t u0 = U * gw / W, u1 = U * (gw + 1) / W;
  if (u0 >= u1) return;
  // The warp's units cover rows r_first..: lane j loads the source token of row r_first + j ahead
  // (one latency for up to 32 rows).
  const int64_t r_first = u0 / nchunks;
  int tok_ahead = -1;
  if (r_first + lane <= (u1 - 1) / nchunks) {
    const int64_t r = r_first + lane;
    const int i = spread_find(s_pre, E, r);
    tok_ahead = __ldg(a.src_info + static_cast<int64_t>(i / R) * RT + (__ldg(a.layout_range + i) >> 32) + (r - s_pre[i]));
  }
  int i = spread_find(s_pre, E, r_first);
  const int i_first = i;
  int64_t b = __ldg(a.layout_range + i) >> 32;  // item i's first row of its expert (checked by the scan)
  for (int64_t u = u0; u < u1;) {
    const int64_t r = u / nchunks, v = min(u1, (r + 1) * nchunks);  // units [u, v) of row r
    if (r >= s_pre[i + 1]) {
      do {
        ++i;
      } while (r >= s_pre[i + 1]);
      b = __ldg(a.layout_range + i) >> 32;
    }
    const int l = i / R, s = i % R;
    const int64_t row = b + (r - s_pre[i]);
    const int tok = r - r_first < 32 ? __shfl_sync(0xffffffffu, tok_ahead, static_cast<int>(r - r_first)) : __ldg(a.src_info + l * RT + row);
    const int c0 = static_cast<int>(u - r * nchunks) * unit, c1 = min(H, static_cast<int>(v - r * nchunks) * unit);
    u = v;
    if (tok < 0 || tok >= T) continue;
    body(l, s, row, tok, c0, c1);
  }
  const int i_last = i;
  __syncwarp();
  // Lane j: item i_first + j (, + 32, ...): this warp's units of it, then the completion test. Each
  // lane that adds fences first (its release: the fence and the add in one thread; cumulative
  // over the other lanes' stores, which the warp barrier ordered before it).
  if (i_first + lane <= i_last) fence_acq_rel_sys();
  unsigned int* done = at<unsigned int>(local(c), kLlItemDone);
  for (int k = i_first + lane; k <= i_last; k += 32) {
    const int64_t lo = static_cast<int64_t>(s_pre[k]) * nchunks, hi = static_cast<int64_t>(s_pre[k + 1]) * nchunks;
    const int64_t n = min(hi, u1) - max(lo, u0);
    if (n <= 0) continue;
    const unsigned int total = static_cast<unsigned int>(hi - lo);
    if (atomicAdd(done + k, static_cast<unsigned int>(n)) + static_cast<unsigned int>(n) != total) continue;
    // This lane completed item k: every other warp's units of it are ordered before its add (fence,
    // then add); the fence below orders them, and the format words, before the signal.
    const int l = k / R, s = k % R;
    done[k] = 0;
    if (l == 0) put_fmt(c, a, 1, s, fmt);
    fence_acq_rel_sys();
    st_relaxed_sys_u32(at<uint32_t>(window(c, s), sig_off(a, a.half) + static_cast<uint64_t>(c.rank * El + l) * 4), tag(seq, 0));
  }
}

// The rows combine send of a one-launch call (no hook, no overlap, no LogFMT, no seam): spread_rows
// with units of kSpreadChunk channels, each run of a row one warp_copy from x (or the zero-copy slot).
template <class Net, int kSpreadChunk>
__device__ __forceinline__ void combine_send_rows_spread(const Ctx& c, const Args& a, uint32_t seq) {
  const int lane = threadIdx.x % 32, R = c.num_ranks, El = a.num_experts / R, T = a.num_max_tokens, H = a.hidden;
  const int64_t RT = static_cast<int64_t>(R) * T, M = H + H / 128 * 2;
  spread_rows<Net>(c, a, seq, kSpreadChunk, false, [&](int l, int s, int64_t row, int tok, int c0, int c1) {
    const uint64_t slot = send_off(a, a.half) + (l * RT + row) * M * 2;  // the zero-copy slot
    const uint16_t* src = a.zero_copy ? reinterpret_cast<const uint16_t*>(local(c) + slot) : static_cast<const uint16_t*>(a.x) + (l * RT + row) * H;
    const uint64_t dst = recv_off(a, a.half) + static_cast<uint64_t>(c.rank * El + l) * T * (2 * static_cast<uint64_t>(H)) +
                         (static_cast<uint64_t>(tok) * H + c0) * 2;
    warp_copy(window(c, s) + dst, src + c0, 2 * static_cast<int64_t>(c1 - c0), lane);
  });
}

}  // namespace
}  // namespace ll
}  // namespace deep_ep
