// low_latency.cu: low-latency combine kernels and the signal reset.
// Protocol: deep_ep_kernels.h ("Low-latency mode"); helpers: low_latency.cuh.
#include <cstdint>
#include <cstring>

#include "ll_combine_local.cuh"
#include "ll_combine_recv.cuh"
#include "ll_combine_spread.cuh"
#include "logfmt.cuh"
#include "low_latency.cuh"

namespace deep_ep {
namespace ll {
namespace {

// Channels one warp moves per work item in the spread send (2 KiB of BF16).
constexpr int kChunk = 1024;
// Channels per item of the per-item rows send (combine_send_rows; latency-bound in rounds, NOTES s35):
// one launch (kWide) 8 KiB, one warp_copy<16> round; two launches (128 registers: 16 spilled) 4 KiB, 8 loads.
template <bool kWide> constexpr int kRowsChunk = kWide ? 4096 : 2 * kChunk;
template <bool kWide> constexpr int kRowsLoads = kWide ? 16 : kUnroll;
// One-launch rows combines of kRowsSharedFrom <= N·K < kSpreadMinSelections take the shared kernel, the rest kOwn's.
constexpr int64_t kRowsSharedFrom = 256;

// ---- combine ----------------------------------------------------------------------------------
// Overlap (Args::signal): waits until the producer of the combine's input raised the signal of row
// `row` of local expert l (>= signal_threshold). The GEMM runs on this GPU meanwhile, so the wait
// polls one word; false: the buffer timed out here or earlier (reported: nothing more is sent and
// no receiver is signalled, so the peers' waits name this rank) or the op was cancelled.
__device__ __noinline__ bool wait_signal(const Ctx& c, const Args& a, int l, int64_t row) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(a.signal + static_cast<int64_t>(l) * a.signal_blocks + row / a.signal_block_m);
  const uint64_t start = globaltimer();
  for (uint32_t polls = 0;; ++polls) {
    const int v = static_cast<int>(ld_acquire_sys_u32(w));
    if (v >= a.signal_threshold) return true;
    // Not op_cancelled: it holds a block barrier, and one thread (lane 0, or an entry's thread) waits here.
    if (polls % 64 == 63 && (timed_out(c) || ld_volatile(at<int>(local(c), kScrOpBad)) != 0)) return false;
    if (globaltimer() - start > c.timeout_ns) {
      report(c, DEK_IC_ERR_TIMEOUT, c.rank, DEK_IC_SITE_LL_SIGNAL, v, a.signal_threshold);
      return false;
    }
  }
}

// One warp before sending row `row` of local expert l (Args::signal): lane 0 waits when the row
// starts a GEMM block the warp has not seen signalled yet (*ready). false: the wait failed.
__device__ __forceinline__ bool warp_rows_ready(const Ctx& c, const Args& a, int l, int64_t row, int lane, int64_t* ready) {
  if (row / a.signal_block_m == *ready) return true;
  const bool ok = __shfl_sync(0xffffffffu, lane == 0 ? wait_signal(c, a, l, row) : false, 0);
  __syncwarp();  // lane 0's acquire orders the warp's loads of the rows after the producer's writes
  *ready = row / a.signal_block_m;
  return ok;
}

// The LogFMT send's shared memory: a pack area per warp (encode_chunk_warp) and the log2 tables (Log2Table),
// one per block, declared at kernel scope by the kernels that may send LogFMT (`combine` over a
// seam type other than NvlNet) and handed down. Not a function-scope __shared__: in this
// separately compiled (rdc) build the device link places such a variable beside every kernel's
// own shared data once two kernels reach it (the dispatch kernels then exceeded 48 KB, branch lfk).
// logfmt_fill_table: every thread of the block calls it, then a barrier.
struct __align__(16) LogfmtSendShared {
  uint8_t pack[kLogfmtSendWarps][logfmt::kPackBytes];
  logfmt::Log2Table tab;
};
__device__ __forceinline__ void logfmt_fill_table(LogfmtSendShared& s) {
  for (int i = threadIdx.x; i < logfmt::kLog2Entries; i += blockDim.x) logfmt::fill_log2_entry(s.tab, i);
  __syncthreads();
}
// The barrier of one half block (kLogfmtSendThreads threads) of the one-launch LogFMT combine, whose
// halves send different items: named barriers 1 and 2 (0 is __syncthreads').
static_assert(kReduceThreads == 2 * kLogfmtSendThreads, "a one-launch LogFMT block is two send halves");
__device__ __forceinline__ void lf_half_sync() {
  if (threadIdx.x < kLogfmtSendThreads) {  // immediate ids: ptxas then reserves 3 barriers, not 16
    asm volatile("bar.sync 1, %0;" ::"n"(kLogfmtSendThreads) : "memory");
  } else {
    asm volatile("bar.sync 2, %0;" ::"n"(kLogfmtSendThreads) : "memory");
  }
}

// The byte offsets in this call's receive half (from the window's start) of the LogFMT row of
// (global expert ge, source token tok): its S meta words and its payload (the layout of logfmt.cuh:
// meta [E][T][S] u32, then payloads [E][T] of 2H bytes). Both LogFMT sends write there.
struct LogfmtRow {
  uint64_t meta, pay;
};
__device__ __forceinline__ LogfmtRow logfmt_row_at(const Args& a, uint64_t ge, int tok) {
  const uint64_t T = a.num_max_tokens, H = a.hidden, S = H / 128, et = ge * T + tok, half = recv_off(a, a.half);
  return {half + et * S * 4, half + static_cast<uint64_t>(a.num_experts) * T * S * 4 + et * 2 * H};
}

// LogFMT rows [b, b + cnt) of local expert l to rank s (combine send, flags DEK_LL_FLAG_LOGFMT):
// one warp per (row, chunk) (blocks of kLogfmtSendThreads without Args::signal, else kLlThreads)
// encodes into the LogFMT layout of logfmt.cuh at global expert
// rank*E_l + l, source token. A rank s outside the NVLink domain is not written through a pointer:
// the warp encodes into this rank's send half (the zero-copy buffer's bytes, unused by a LogFMT
// combine: payloads [E_l][R*T] of 2H bytes from its start, then meta words [E_l][R*T][S]) and puts
// the chunk's payload and meta words to the offsets of s that the NVLink stores would reach. The
// payload put covers whole 256-byte groups: bytes 160.. of a cast group are not part of the layout.
// Returns false when a signal wait (Args::signal) failed: the rest is not sent.
// kHalf (the one-launch LogFMT combine's 512-thread blocks): the item is one half's (kLogfmtSendWarps
// warps, the pack area's; warp counts within the half), its table filled before (combine_send).
// tab: the log2 tables the encoder reads (sh.tab, or with kHalf the block's one, lf[0].tab).
template <class Net, bool kSig, bool kFull = false, bool kHalf = false>
__device__ bool ll_combine_send_logfmt(const Ctx& c, const Args& a, int s, int l, int64_t b, int64_t cnt, int warp, int lane,
                                       LogfmtSendShared& sh, const logfmt::Log2Table& tab) {
  // Every thread of the block is here (the LogFMT flag and the item are the block's): one table.
  if constexpr (!kHalf) logfmt_fill_table(sh);
  const int R = c.num_ranks, El = a.num_experts / R, T = a.num_max_tokens, H = a.hidden, S = H / 128;
  const int64_t RT = static_cast<int64_t>(R) * T;
  const int chunk = logfmt::chunk_channels(H), nch = (H + chunk - 1) / chunk;
  const int nw = kHalf ? kLogfmtSendWarps : static_cast<int>(blockDim.x / 32);
  const LogfmtRow first = logfmt_row_at(a, static_cast<uint64_t>(c.rank) * El + l, 0);  // the expert's token 0: a row per token from there
  const bool far = remote<Net>(c, a, s);
  char* const dst = window(c, far ? c.rank : s);
  int64_t ready = -1;
  for (int64_t it = warp; it < cnt * nch; it += nw) {
    const int64_t row = b + it / nch;
    if (kSig && !warp_rows_ready(c, a, l, row, lane, &ready)) return false;
    const int c0 = static_cast<int>(it % nch) * chunk, ng = (min(H, c0 + chunk) - c0) / 128;
    const int tok = a.src_info[l * RT + row];
    if (tok < 0 || tok >= T) continue;
    const uint64_t m_off = first.meta + (static_cast<uint64_t>(tok) * S + c0 / 128) * 4, p_off = first.pay + (static_cast<uint64_t>(tok) * H + c0) * 2;
    uint64_t m_at = m_off, p_at = p_off;
    if (far) {
      const uint64_t r = static_cast<uint64_t>(l * RT + row), st = send_off(a, a.half);
      p_at = st + (r * H + c0) * 2;
      m_at = st + static_cast<uint64_t>(El) * RT * 2 * H + (r * S + c0 / 128) * 4;
    }
    logfmt::send_chunk_warp<kFull>(static_cast<const uint16_t*>(a.x) + (l * RT + row) * H + c0, ng, at<uint32_t>(dst, m_at), dst + p_at, &tab,
                            sh.pack[warp], lane);
    if (far) {
      __syncwarp();  // every lane's staged bytes (and lane 0's meta words) before the puts read them
      put_to<Net>(c, a, s, p_off, p_at, 256 * static_cast<uint64_t>(ng), lane);
      put_to<Net>(c, a, s, m_off, m_at, 4 * static_cast<uint64_t>(ng), lane);
    }
  }
  return true;
}

// The most items (E) of the one-launch LogFMT combine's spread send (its spread_rows scan): with
// the scan sized for every expert (2048) the kernel's static shared memory came to 55,200 bytes,
// over the 48 KB a static allocation may take (session 46, lf4). Above it that kernel's calls
// send per item (one_launch_logfmt_spread).
constexpr int kOneLaunchSpreadItems = DEK_LL_LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS;

// The LogFMT send with its rows spread over the grid's warps (spread_rows; the launcher's choice,
// logfmt_spread): per run of a row, each chunk loaded and encoded into the LogFMT layout of rank s
// by NVLink stores, at the places ll_combine_send_logfmt writes for a peer inside the domain.
// sh: the kernel's send areas. kHalves (the one-launch LogFMT combine's 512-thread blocks, the
// block's one table, sh[0]'s, filled before): warp w packs in its half's area, sh[w / kLogfmtSendWarps], and the scan
// holds kOneLaunchSpreadItems items. kTag: spread_rows' (1 in the LogFMT send kernel, 0 in the
// general send kernels that take this form at run time).
template <class Net, bool kHalves = false, int kTag = 0>
__device__ void combine_send_logfmt_spread(const Ctx& c, const Args& a, uint32_t seq, LogfmtSendShared* sh) {
  constexpr int kMaxItems = kHalves ? kOneLaunchSpreadItems : kMaxLlExperts;
  if constexpr (!kHalves) logfmt_fill_table(*sh);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  LogfmtSendShared& mine = sh[kHalves ? warp / kLogfmtSendWarps : 0];
  uint8_t* const pack = mine.pack[kHalves ? warp % kLogfmtSendWarps : warp];
  const int R = c.num_ranks, El = a.num_experts / R, T = a.num_max_tokens, H = a.hidden;
  const int64_t RT = static_cast<int64_t>(R) * T;
  const int chunk = logfmt::chunk_channels(H);
  spread_rows<Net, kMaxItems, kTag>(c, a, seq, chunk, true, [&](int l, int s, int64_t row, int tok, int c0, int c1) {
    const LogfmtRow at_row = logfmt_row_at(a, static_cast<uint64_t>(c.rank) * El + l, tok);
    char* const dst = window(c, s);
    for (int k = c0; k < c1; k += chunk) {
      const int ng = (min(H, k + chunk) - k) / 128;
      logfmt::send_chunk_warp<false>(static_cast<const uint16_t*>(a.x) + (l * RT + row) * H + k, ng, at<uint32_t>(dst, at_row.meta + k / 128 * 4),
                              dst + at_row.pay + 2 * static_cast<uint64_t>(k), &sh->tab, pack, lane);
    }
  });
}

// Item (l, s) of the per-expert combine send: pushes rows layout_range[l][s] of local expert l
// back to source rank s, keyed by (global expert, source token), then signals word s_global =
// rank*E_l + l on rank s. A source outside the NVLink domain gets each row by a seam put from its
// zero-copy slot (send_to), or with LogFMT each encoded chunk by puts from the send half
// (ll_combine_send_logfmt). With Args::signal a warp waits for each GEMM block of rows before
// sending from it (warp_rows_ready); false: a wait failed. kOwn (one launch): for s = this rank under
// own_rows_direct, only the rows' indices go to their places (no copy). kWide: kRowsChunk's.
// lf: the kernel's LogFMT send area (null over NvlNet: no LogFMT). kLf (the LogFMT send
// instantiation): LogFMT rows only, no BF16 code.
template <class Net, bool kSig, bool kOwn = false, bool kWide = false, bool kLf = false>
__device__ __forceinline__ bool combine_send_rows(const Ctx& c, const Args& a, int l, int s, uint32_t seq, LogfmtSendShared* lf) {
  // kLf && kWide (the one-launch LogFMT combine): the item is a half block's (lf_half_sync).
  constexpr bool kHalf = kLf && kWide;
  const int tid = kHalf ? threadIdx.x % kLogfmtSendThreads : threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, El = a.num_experts / R, T = a.num_max_tokens, H = a.hidden;
  const int64_t RT = static_cast<int64_t>(R) * T, M = H + H / 128 * 2;
  const int64_t lr = a.layout_range[l * R + s];
  const int64_t b = lr >> 32;
  int64_t cnt = lr & 0xffffffffLL;
  if (b < 0 || cnt > T || b + cnt > RT) cnt = 0;  // not from a dispatch of this geometry (the host checks shapes)
  const bool dead = rank_masked(a, s);  // nothing goes to a masked rank (the block still counts as done)
  if (dead) cnt = 0;
  char* peer = window(c, s);
  const uint64_t dst_base = recv_off(a, a.half) + static_cast<uint64_t>(c.rank * El + l) * T * (2 * static_cast<uint64_t>(H));
  bool ok = true;
  if constexpr (kLf) {
    // kHalf: lf is the block's two areas; this half packs in its own and reads the block's one table
    // (lf[0]'s: a static shared address, no per-lookup base add).
    ok = ll_combine_send_logfmt<Net, kSig, true, kHalf>(c, a, s, l, b, cnt, warp, lane, lf[kHalf ? threadIdx.x / kLogfmtSendThreads : 0], lf->tab);
    cnt = 0;
  } else if constexpr (!kNvlOnly<Net>) {  // NvlNet launchers refuse LogFMT (one_launch_combine_ok, launch_combine)
    if (a.flags & DEK_LL_FLAG_LOGFMT) {
      ok = ll_combine_send_logfmt<Net, kSig>(c, a, s, l, b, cnt, warp, lane, *lf, lf->tab);
      cnt = 0;  // every row went out as LogFMT: nothing left for the BF16 loop
    }
  }
  if (!kLf && kOwn && s == c.rank && own_rows(a)) {
    for (int64_t r = tid; r < cnt; r += blockDim.x) {
      const int64_t row = b + r;
      const int tok = a.src_info[l * RT + row];
      if (tok >= 0 && tok < T) *at<int64_t>(peer, dst_base + static_cast<uint64_t>(tok) * 2 * H) = l * RT + row;
    }
    cnt = 0;  // ordered before the signal like the copies: the barrier below, then tid 0's release store
  }
  const int nchunks = (H + kRowsChunk<kWide> - 1) / kRowsChunk<kWide>;
  int64_t ready = -1;  // the GEMM block of rows this warp last found signalled
  for (int64_t it = warp; !kLf && it < cnt * nchunks; it += kLlWarps) {
    const int64_t row = b + it / nchunks;
    if (kSig && !(ok = warp_rows_ready(c, a, l, row, lane, &ready))) break;
    const int c0 = static_cast<int>(it % nchunks) * kRowsChunk<kWide>, c1 = min(H, c0 + kRowsChunk<kWide>);
    const int tok = a.src_info[l * RT + row];
    if (tok < 0 || tok >= T) continue;
    const uint64_t slot = send_off(a, a.half) + (l * RT + row) * M * 2;  // zero-copy slot: staging for the seam
    const uint16_t* src = a.zero_copy ? reinterpret_cast<const uint16_t*>(local(c) + slot) : static_cast<const uint16_t*>(a.x) + (l * RT + row) * H;
    send_to<Net, kRowsLoads<kWide>>(c, a, s, dst_base + (static_cast<uint64_t>(tok) * H + c0) * 2, src + c0, slot + 2 * static_cast<uint64_t>(c0),
                 2 * static_cast<int64_t>(c1 - c0), lane);
  }
  flush_net<Net>(c, a, lane);
  // A failed signal wait (any warp) leaves the item unsignalled: its receiver times out naming this rank.
  if constexpr (kSig) {
    ok = __syncthreads_and(ok);
  } else if constexpr (kHalf) {
    lf_half_sync();
  } else {
    __syncthreads();
  }
  if (tid == 0 && !dead && ok) {
    if (l == 0 && !remote<Net>(c, a, s)) put_fmt(c, a, 1, s, fmt_combine((a.flags & DEK_LL_FLAG_LOGFMT) != 0, false));
    // One cumulative fence per block (see dispatch_send in ll_dispatch.cu) before a seam signal;
    // an NVLink signal is a release store of this thread, the same fence.
    if (remote<Net>(c, a, s)) fence_acq_rel_sys();
    uint32_t* word = at<uint32_t>(peer, sig_off(a, a.half) + static_cast<uint64_t>(c.rank * El + l) * 4);
    raise_to<Net>(c, a, s, word, kSeamCombine, a.half, l, tag(seq, 0));
  }
  return ok;
}

// The per-expert combine send: block b of (E_l, R) blocks (the grid, or a 1-D one of E blocks)
// takes item (b % E_l, b / E_l); with Args::signal_grid at most that many blocks, each taking
// items l + E_l*s in turn; kSpread (a one-launch call): the items' rows spread over the grid's
// warps (ll_combine_spread.cuh), whatever the grid. Returns false when the buffer timed out
// (nothing sent); *seq: the call's number. kOwn, kWide, kLf, lf: combine_send_rows' (kWide: a
// one-launch kernel). kLfSpread (kLf only): the LogFMT send kernel's form, the launcher's
// logfmt_spread (one launch: one_launch_logfmt_spread) choice made at compile time (each form's
// instantiation holds only its own code).
template <class Net, bool kSig, bool kSpread = false, bool kOwn = false, bool kWide = false, bool kLf = false, bool kLfSpread = false>
__device__ __forceinline__ bool combine_send(const Ctx& c, const Args& a, uint32_t* seq, LogfmtSendShared* lf = nullptr) {
  __shared__ uint32_t s_seq;
  __shared__ int s_skip;
  if (!begin_send(c, a, DEK_LL_KIND_COMBINE, &s_seq, &s_skip)) return false;
  *seq = s_seq;
  const int El = a.num_experts / c.num_ranks, lin = blockIdx.y * gridDim.x + blockIdx.x;
  if constexpr (kSpread) {
    combine_send_rows_spread<Net, kChunk>(c, a, s_seq);
  } else if constexpr (kSig) {
    for (int w = lin; w < El * c.num_ranks; w += gridDim.x * gridDim.y) {
      if (!combine_send_rows<Net, true>(c, a, w % El, w / El, s_seq, lf)) break;
    }
  } else if constexpr (kLf && kWide) {
    // The one-launch LogFMT combine: a resident grid of one block per SM, each half block of
    // kLogfmtSendWarps warps an item at a time with its own pack area lf[half] (2 x SMs items at once:
    // with the block's one at a time, a block holding two rows' items doubled the send, session 46).
    const int h = static_cast<int>(threadIdx.x) / kLogfmtSendThreads;
    logfmt_fill_table(lf[0]);  // the block's one table: both halves read lf[0].tab
    if constexpr (kLfSpread) {
      // From kLogfmtSpreadFrom selections: the rows spread over every warp of the grid, as the
      // two-launch send's (the per-item form's heaviest item set the cast encode's time, session 46).
      combine_send_logfmt_spread<Net, true>(c, a, s_seq, lf);
    } else {
      for (int w = 2 * lin + h; w < El * c.num_ranks; w += 2 * gridDim.x * gridDim.y)
        combine_send_rows<Net, false, false, true, true>(c, a, w % El, w / El, s_seq, lf);
    }
    __syncthreads();  // both halves' items before the block counts itself done
  } else if (!kNvlOnly<Net> && !kOwn && !kWide && (kLf ? kLfSpread : logfmt_spread(a))) {
    combine_send_logfmt_spread<Net, false, kLf ? 1 : 0>(c, a, s_seq, lf);  // a 1-D grid (the launcher's, as it chose this form)
  } else {
    // E blocks: one item each; blocks past E (the kOwn kernel's wider grid) only receive.
    if (!kOwn || lin < El * c.num_ranks) combine_send_rows<Net, false, kOwn, kWide, kLf>(c, a, lin % El, lin / El, s_seq, lf);
  }
  finish_send(c, s_seq);
  return true;
}

// Partial combine: block (s, y) of (R, Y) (block b of a 1-D grid: (b % R, b / R), Y = blocks / R)
// takes work items y, y+Y, ... (a message that source rank s sent in the dispatch (dispatch_half),
// or a slice of its channels when there are fewer messages than blocks): thread j owns channels
// 8j..8j+7 of the row bf16(sum over the message's entries in order of fma(y, w, acc)) (crate:
// f32::mul_add) and stores it to s at (rank, token).
// The last block to finish signals word rank*E_l on every unmasked source rank. For a source s
// outside the NVLink domain the row is staged in the payload of the message it answers (no longer
// read: the dispatch receive copied it) and put by warp 0. kWide (the one-launch kernel): messages
// of at most 4 entries load 2 or 4 units per thread at once.
// Returns false when the buffer timed out (nothing sent); *seq: the call's number.
template <class Net, bool kSig, bool kWide>
__device__ __forceinline__ bool combine_send_partial(const Ctx& c, const Args& a, uint32_t* seq) {
  __shared__ uint32_t s_seq;
  __shared__ int s_skip, s_last, s_n, s_tok;
  __shared__ int64_t s_row[kMaxLlTopk];
  __shared__ float s_w[kMaxLlTopk];
  if (!begin_send(c, a, DEK_LL_KIND_COMBINE, &s_seq, &s_skip)) return false;
  *seq = s_seq;
  const int R = c.num_ranks, El = a.num_experts / R, T = a.num_max_tokens, H = a.hidden;
  const uint32_t blocks = gridDim.x * gridDim.y, lin = blockIdx.y * gridDim.x + blockIdx.x;
  const int s = static_cast<int>(lin % R), tid = threadIdx.x;
  const uint32_t y = lin / R, Y = blocks / R;  // blocks past R * Y (a 1-D grid) only count themselves done
  const int64_t RT = static_cast<int64_t>(R) * T, M = H + H / 128 * 2;
  const char* me = local(c);
  const uint64_t drecv = recv_off(a, a.dispatch_half);
  const uint32_t nm = rank_masked(a, s) ? 0u : min(__ldcg(reinterpret_cast<const unsigned int*>(me + drecv) + s), static_cast<uint32_t>(T));
  const uint64_t dst_off = recv_off(a, a.half) + a.partial_off + static_cast<uint64_t>(c.rank) * T * 2 * H;
  const bool seam = remote<Net>(c, a, s);
  char* dst = window(c, s) + dst_off;
  // The format words early (block (s, 0)), ordered by this block's fence below: not between the
  // last block's ticket and its signals, where their NVLink stores held up the signals' fence.
  if (y == 0 && tid == 0 && !seam && !rank_masked(a, s)) put_fmt(c, a, 1, s, fmt_combine(false, true));
  // Rows of zero-copy buffers are M bf16 long: 16-byte loads only when M*2 is a multiple of 16.
  const bool vec = !a.zero_copy || (M * 2) % 16 == 0;
  // Work item w: message w / P, unit slice w % P. With fewer messages than blocks, a message's H/8
  // units are split over P blocks (one round of row loads per thread instead of up to 8 in one
  // block, which set the 1-token time: bench/LL_PROFILE.md section 11). A seam source keeps
  // whole messages (warp 0 puts the row).
  const int U = H / 8;
  const uint32_t P = seam || nm == 0 ? 1u : max(1u, min(Y / nm, static_cast<uint32_t>((U + kLlThreads - 1) / kLlThreads)));
  bool failed = false;
  for (uint32_t w = y; y < Y && w < nm * P; w += Y) {
    const uint32_t m = w / P;
    const int u_lo = static_cast<int>(static_cast<uint64_t>(w % P) * U / P), u_hi = static_cast<int>(static_cast<uint64_t>(w % P + 1) * U / P);
    const char* msg = me + drecv + a.msgs_off + (static_cast<uint64_t>(s) * T + m) * a.msg_bytes;
    if (tid == 0) {
      const int4 hdr = __ldcg(reinterpret_cast<const int4*>(msg));
      const int4 h1 = __ldcg(reinterpret_cast<const int4*>(msg + 16));
      s_tok = hdr.x >= 0 && hdr.x < T && hdr.y == H && hdr.z == T && hdr.w == a.num_experts ? hdr.x : -1;
      s_n = min(max(h1.x, 0), kMaxLlTopk);
      if (s_tok < 0) report(c, DEK_IC_ERR_MISMATCH, s, DEK_IC_SITE_LL_COMBINE, hdr.y, H);
    }
    __syncthreads();
    if (tid < s_n) {
      const uint32_t en = __ldcg(reinterpret_cast<const unsigned int*>(msg + 32) + tid);
      const int l = static_cast<int>(en >> 16), slot = static_cast<int>(en & 0xffffu);
      const int64_t lr = l < El ? a.layout_range[l * R + s] : 0;
      const int64_t b = lr >> 32, cnt = lr & 0xffffffffLL;
      s_row[tid] = l < El && slot < cnt && b + slot < RT ? l * RT + b + slot : -1;
      s_w[tid] = __ldcg(reinterpret_cast<const float*>(msg + 32 + 4 * kMaxLlTopk) + tid);
      if (s_row[tid] < 0) report(c, DEK_IC_ERR_MISMATCH, s, DEK_IC_SITE_LL_COMBINE, slot, static_cast<int>(cnt));
      // Overlap: each entry's thread waits for its row's GEMM block (the barrier below orders the
      // block's loads of the rows after these acquires).
      else if (kSig && !wait_signal(c, a, l, b + slot)) failed = true;
    }
    // A failed signal wait: nothing more is sent and no rank is signalled (their waits name this rank).
    if (kSig ? __syncthreads_or(failed) : (__syncthreads(), false)) break;
    if (s_tok >= 0) {
      char* out_row = seam ? const_cast<char*>(msg) + kMsgMeta : dst + static_cast<uint64_t>(s_tok) * 2 * H;
      if (vec) {
        // One launch (kWide): fewer entries leave loads for more units (bench/NOTES.md, session 23).
        if (kWide && s_n <= 2) {
          partial_units<2, 4>(c, a, u_lo, u_hi, s_n, s_row, s_w, out_row);
        } else if (kWide && s_n <= 4) {
          partial_units<4, 2>(c, a, u_lo, u_hi, s_n, s_row, s_w, out_row);
        } else {
          partial_units<8, 1>(c, a, u_lo, u_hi, s_n, s_row, s_w, out_row);
        }
      } else {
        for (int j = u_lo + tid; j < u_hi; j += kLlThreads) {
          float acc[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
          for (int q = 0; q < s_n; ++q) {
            const int64_t row = s_row[q];
            if (row < 0) continue;
            const unsigned int* y = reinterpret_cast<const unsigned int*>(me + send_off(a, a.half) + row * M * 2);  // zero-copy rows
            uint32_t wv[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) wv[u] = __ldcg(y + 4 * j + u);
            fma_bf16x8(acc, wv, s_w[q]);
          }
          reinterpret_cast<int4*>(out_row)[j] = pack_bf16x8(acc);
        }
      }
    }
    if (seam) {
      __syncthreads();
      if (tid < 32 && s_tok >= 0) {
        put_to<Net>(c, a, s, dst_off + static_cast<uint64_t>(s_tok) * 2 * H, static_cast<uint64_t>(msg + kMsgMeta - me), 2 * static_cast<uint64_t>(H), tid);
      }
    }
    __syncthreads();  // s_tok, s_n, s_row, s_w are rewritten for the next message
  }
  if (seam && tid < 32) flush_net<Net>(c, a, tid);
  __syncthreads();
  if (tid == 0) {
    fence_acq_rel_sys();  // one cumulative fence per block (see dispatch_send in ll_dispatch.cu)
    s_last = atomicAdd(at<unsigned int>(local(c), kLlDone), 1u) == blocks - 1;
  }
  __syncthreads();
  if (!s_last) return true;
  // A failed signal wait of any block timed the buffer out (or the op was cancelled): no signals.
  const bool give_up = kSig && op_cancelled(c);  // timed out or cancelled (one barrier: every thread of the block)
  constexpr int kSignallers = rank_workers(kLlThreads);  // threads signalling the ranks, each R / kSignallers
  fence_acq_rel_sys();
  for (int d = tid; d < R && tid < kSignallers; d += kSignallers) {
    if (give_up || rank_masked(a, d)) continue;
    raise_to<Net>(c, a, d, at<uint32_t>(window(c, d), sig_off(a, a.half) + static_cast<uint64_t>(c.rank * El) * 4), kSeamCombine, a.half, 0, tag(s_seq, 0));
  }
  __syncthreads();
  if (tid == 0) {
    end_call(c, s_seq);
    __threadfence();
  }
  return true;
}

}  // namespace

// ---- the kernel ------------------------------------------------------------------------------
// One kernel for every half of the combine, chosen by `phase` (as DeepEP's): profilers and
// benchmarks that look kernels up by name find exactly one `combine` (docs/OPS.md, "Kernel
// names"). Send (per-expert rows or partial sums): kLlThreads per block; receive: kReduceThreads.
// kSig: the send waits for the producer's signals (overlap, Args::signal), its own instantiation so
// the plain combine keeps its registers; it only sends (kLlThreads, no 512-thread register cap).
// kBoth (DEK_LL_PHASE_BOTH: no hook, no overlap, not LogFMT, no seam): every block of a 1-D grid
// of kLlThreads sends, then reduces work items with the call's half and number its own (no
// recv_state), over NvlNet. Its own instantiation: beside the two-launch code its registers spilled
// and the way out made the partial combine 40 % slower at 128 tokens (NOTES-2026-11-28.md, s19).
// kLocal (one rank, dek_ll_combine_local): the sums straight from y (ll_combine_local.cuh); with
// kLfLocal the LogFMT form (combine_local_logfmt), kLfLocalThreads per block.
// kOwn (with kBoth): the rows-only one-launch combine (dek_ll_combine's choice by selections): 8
// rows' loads in flight per thread; from kSpreadMinSelections selections on (own_rows) this rank's
// own rows are reduced from where they are, not copied (combine_send_rows, combine_recv_tokens). kPartial
// (with kBoth): partial sums only, kBoth alone rows only, each without the other's code (NOTES s34).
// kLfRecv: the receive launch of a combine whose send the host recorded as LogFMT
// (dek_ll_combine_recv), an instantiation of its own with the receive's wide form inline, so that
// the BF16 receive keeps none of its code (in the shared kernel it spilled 48 bytes and cost the
// hook step 0.3-0.5 µs, session 40); kLfRecvHalf: the same where the narrow form runs
// (logfmt_narrow: few tokens), apart from kLfRecv so that neither form moves the other's
// registers (together, the wide form's cast receive at 128 tokens was 1.1 µs slower, session 45).
// Both read the format from recv_state like every receive: a wrong hint costs time, never
// results. Under the op's one kernel name (docs/OPS.md's kernel table: profiler lookups by name,
// as DeepEP's benchmark makes, see one `combine`).
// kLfSend: the send launch of a LogFMT combine without overlap waits or seam (dek_ll_combine_send),
// an instantiation of its own with no BF16, partial or receive code (no stack; the shared LsaNet
// kernel spills), at 2 blocks of 256 threads per SM (cast -1.5 to -5 µs with enc1, session 42);
// with kSpread its spread form (logfmt_spread), without its per-item form: two instantiations, as
// one kernel holding both moved the spread form's time with the other's code (session 43).
// kBoth with kLfRecvHalf: the one-launch LogFMT combine (dek_ll_combine), the per-item send; with
// kSpread too, the spread send (one_launch_logfmt_spread), each form its own instantiation.
template <class Net, bool kSig, bool kBoth = false, bool kSpread = false, bool kLocal = false, bool kOwn = false, bool kPartial = false,
          bool kLfRecv = false, bool kLfSend = false, bool kLfRecvHalf = false, bool kLfLocal = false>
__global__ void __launch_bounds__(kLfLocal                   ? kLfLocalThreads
                                  : kBoth && !kLfRecvHalf    ? kLlThreads
                                  : kSig                     ? kLlThreads
                                  : kLfSend                  ? kLogfmtSendThreads
                                                             : kReduceThreads,
                                  kLfLocal                ? kLfLocalBlocksPerSm
                                  : kBoth && !kLfRecvHalf ? kBothBlocksPerSm
                                  : kLfSend               ? kLogfmtSpreadBlocksPerSm
                                                          : 1)
    combine(const __grid_constant__ Ctx c, const __grid_constant__ Args a, int phase) {
  __shared__ CombineRecvShared<kOwn ? kMaxLlTopk : 1, kLfRecvHalf> rsh;  // the kernel's own (CombineRecvShared)
  if (!kBoth && !kLfSend && (kLfRecv || kLfRecvHalf || phase == DEK_LL_PHASE_RECV)) {
    if constexpr (!kSig) combine_recv<Net, kLfRecv ? kLfWide : kLfRecvHalf ? kLfHalf : kLfGeneric>(c, a, rsh);
    return;
  }
  LogfmtSendShared* lf = nullptr;  // the LogFMT send's area, in the kernels that may send LogFMT
  if constexpr (!kNvlOnly<Net>) {
    // One-launch LogFMT: one per half block (their pack areas; both halves read s_lf[0].tab).
    __shared__ LogfmtSendShared s_lf[kBoth && kLfRecvHalf ? 2 : 1];
    lf = s_lf;
  }
  uint32_t seq = 0;
  if constexpr (kLfSend) {
    combine_send<Net, false, false, false, false, true, kSpread>(c, a, &seq, lf);
    return;
  }
  if constexpr (kBoth) {  // the one-launch forms are launched early (launch_pdl): wait for the kernel before
    pdl_wait();
    // One rank: let the next kernel launch now, unless this grid fills its bound on every SM (3 x
    // SMs: at 128 tokens the trigger cost 0.2 µs there and gained 0.25 below it, NOTES session 28).
    // With peers never: the next kernel's early blocks slowed the 128-token receive by 0.35-0.6 µs
    // (2 ranks, bench/NOTES.md session 29).
    if (kLocal && gridDim.x < (kLfLocal ? kLfLocalBlocksPerSm : kBothBlocksPerSm) * static_cast<unsigned>(c.num_sms)) pdl_trigger();
  }
  if constexpr (kBoth && kLfRecvHalf) {
    // The one-launch LogFMT combine (kLfBoth): the per-item LogFMT send, then the LogFMT receive with
    // both forms inline (the half form where logfmt_narrow holds on this grid).
    // With kSpread the spread send (one_launch_logfmt_spread), an instantiation of its own: in the
    // per-item form's kernel it cost 1-8 tokens 0.2-0.3 µs (lf4, session 46).
    if (combine_send<Net, false, false, false, true, true, kSpread>(c, a, &seq, lf)) {
      combine_recv_tokens<Net, 8, false, false, kLfHalf>(c, a, a.half, seq, false, true, rsh);
    }
    return;
  }
  if constexpr (kLocal) {
    if constexpr (kLfLocal) {
      combine_local_logfmt<Net>(c, a);
    } else {
      combine_local<Net>(c, a);
    }
    return;
  }
  if constexpr (kSpread && !kLfRecvHalf) {
    // Rows only, an instantiation of its own (112 registers; the other one-launch paths keep their
    // code): its receive has every top-8 row's load in flight at once.
    if (combine_send<Net, false, true>(c, a, &seq)) combine_recv_tokens<Net, 8>(c, a, a.half, seq, false, false, rsh);
    return;
  }
  if constexpr (kOwn) {
    // Rows only, an instantiation of its own (140 registers: a top-8 token's 8 row loads at once; in the
    // shared kernel the own-rows code cost the partial combine 0.1-0.3 µs, session 31). Own rows: own_rows.
    if (combine_send<Net, false, false, true, true>(c, a, &seq)) combine_recv_tokens<Net, 8, true>(c, a, a.half, seq, false, false, rsh);
    return;
  }
  const bool partial = kBoth ? kPartial : a.partial != 0;
  const bool sent = partial ? combine_send_partial<Net, kSig, kBoth>(c, a, &seq) : combine_send<Net, kSig, false, false, kBoth>(c, a, &seq, lf);
  if (kBoth && sent) combine_recv_tokens<Net>(c, a, a.half, seq, partial, false, rsh);
}

template <class Net>
__global__ void clean_signals(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  uint32_t* w = at<uint32_t>(local(c), a.ll_off);
  const uint64_t i0 = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
  for (uint64_t i = i0; i < a.signal_bytes / 2; i += step) w[i] = 0;
  if (!has_seam<Net>(a)) return;
  // Seam signals this geometry uses (every communicator and context) and their shadows (the peers
  // do the same).
  const uint64_t n = 4ull * a.num_experts;
  uint64_t* shadow = at<uint64_t>(local(c), a.shadow_off);
  for (uint64_t i = i0; i < n; i += step) shadow[i] = 0;
  const Net& net = net_of<Net>(a);
  for (int k = 0; k < net.units(); ++k) {
    const auto t = net.at(k);
    for (uint64_t i = i0; i < n; i += step) t.reset_signal(static_cast<int>(i));
  }
}

namespace {

// `combine` over Net, with the signal waits (overlap) or without.
template <class Net>
auto combine_for(bool sig) { return sig ? combine<Net, true> : combine<Net, false>; }

// The combine on the seam of `a` (none and no LogFMT: NvlNet), with the signal waits (overlap) or without.
void launch_combine(const dek_ic_ctx_t* ctx, const dek_ll_args_t* a, dim3 grid, int threads, int phase, void* stream) {
  const bool gin = a->net != nullptr && a->net_kind == DEK_LL_NET_GIN, sig = a->signal != nullptr && phase == DEK_LL_PHASE_SEND;
  const bool nvl = a->net == nullptr && (a->flags & DEK_LL_FLAG_LOGFMT) == 0;
  auto* k = gin ? combine_for<GinNet>(sig) : nvl ? combine_for<NvlNet>(sig) : combine_for<LsaNet>(sig);
  k<<<grid, threads, 0, deep_ep::as_stream(stream)>>>(*ctx, *a, phase);
}

}  // namespace
}  // namespace ll
}  // namespace deep_ep

using namespace deep_ep::ll;

namespace {
// A LogFMT combine's arguments (both launch forms): rows from x (no partial sums, no zero-copy),
// its layout in the receive half, the payload 16-byte aligned (logfmt.cuh).
bool logfmt_layout_ok(const dek_ll_args_t* args) {
  const uint64_t et = static_cast<uint64_t>(args->num_experts) * args->num_max_tokens, s = args->hidden / 128;
  return !args->partial && !args->zero_copy && et * (4 * s + 2 * static_cast<uint64_t>(args->hidden)) <= args->recv_bytes && et * s % 4 == 0;
}
}  // namespace

extern "C" int dek_ll_combine_send(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args) || args->recv_state == nullptr || args->src_info == nullptr || args->layout_range == nullptr ||
      (!args->zero_copy && args->x == nullptr))
    return static_cast<int>(cudaErrorInvalidValue);
  const int el = args->num_experts / ctx->num_ranks;
  // Over the seam a per-expert combine stages remote rows in the send half: BF16 rows at their
  // zero-copy slot, LogFMT payloads + meta words; both E_l*R*T*(2H + 4*H/128) bytes.
  const uint64_t rows = static_cast<uint64_t>(args->num_experts) * args->num_max_tokens, h = args->hidden;
  if (args->net != nullptr && !args->partial && rows * (2 * h + 4 * (h / 128)) > args->send_bytes) return static_cast<int>(cudaErrorInvalidValue);
  if ((args->flags & DEK_LL_FLAG_LOGFMT) && !logfmt_layout_ok(args)) return static_cast<int>(cudaErrorInvalidValue);
  if (args->signal != nullptr && (args->signal_block_m < 1 || args->signal_blocks < 1 || args->signal_grid < 0))
    return static_cast<int>(cudaErrorInvalidValue);
  // Overlap: signal_grid > 0 caps the blocks, which spin while the producer runs beside them.
  const int cap = args->signal != nullptr && args->signal_grid > 0 ? args->signal_grid : 0;
  if (args->partial) {
    // Blocks (source rank, y): ~2 per SM in all; each takes every gridDim.y-th message.
    const int blocks = cap > 0 && cap < args->num_blocks ? cap : args->num_blocks;
    const int y = blocks > ctx->num_ranks ? blocks / ctx->num_ranks : 1;
    launch_combine(ctx, args, dim3(ctx->num_ranks, y), kLlThreads, DEK_LL_PHASE_SEND, stream);
    return static_cast<int>(cudaGetLastError());
  }
  const bool wide = (args->flags & DEK_LL_FLAG_LOGFMT) && args->signal == nullptr;  // the kernel bound is kReduceThreads
  // The spread LogFMT send: kLogfmtSpreadBlocksPerSm blocks per SM (all resident: its warps split
  // the units evenly and none waits for another), whatever E is.
  const dim3 grid = logfmt_spread(*args) ? dim3(ctx->num_sms > 0 ? kLogfmtSpreadBlocksPerSm * ctx->num_sms : el * ctx->num_ranks)
                    : cap > 0 && cap < el * ctx->num_ranks ? dim3(cap)
                                                           : dim3(el, ctx->num_ranks);
  const int threads = wide && ll_selections(*args) >= kLogfmtWideFrom ? kLogfmtSendThreads : kLlThreads;
  if (wide && args->net == nullptr) {  // the LogFMT send's own instantiation (no seam: LsaNet's NVLink stores)
    // Its two forms are two instantiations (kSpread: the spread one), chosen as the grid was.
    const auto kernel = logfmt_spread(*args) ? combine<LsaNet, false, false, true, false, false, false, false, true>
                                             : combine<LsaNet, false, false, false, false, false, false, false, true>;
    kernel<<<grid, threads, 0, deep_ep::as_stream(stream)>>>(*ctx, *args, DEK_LL_PHASE_SEND);
  } else {
    launch_combine(ctx, args, grid, threads, DEK_LL_PHASE_SEND, stream);
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" int dek_ll_combine_recv(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args) || args->recv_state == nullptr || (args->num_tokens > 0 && (args->out == nullptr || args->topk_idx == nullptr ||
                                                                                  args->topk_weights == nullptr)))
    return static_cast<int>(cudaErrorInvalidValue);
  // No token: it still waits for every word. A token's H/8 units over P blocks (one round of loads
  // each; LogFMT: one pass of 4096 channels each, the same P or fewer) and a block for the routing
  // check, within num_blocks (one per SM). flags & DEK_LL_FLAG_LOGFMT is the host's hint that the
  // send was LogFMT (the format itself is the send's, in recv_state): then a block per half pass
  // of 2048 channels (the narrow form) on the LogFMT receive instantiation, where no seam is between.
  const bool lf = (args->flags & DEK_LL_FLAG_LOGFMT) != 0 && args->net == nullptr;
  const int64_t n = args->num_tokens, units = (args->hidden / 8 + kReduceThreads - 1) / kReduceThreads;
  const int64_t p = lf ? std::max<int64_t>(units, logfmt_pass_count(static_cast<int>(args->hidden), kLogfmtHalf)) : units;
  const int blocks = n < 1 ? 1 : static_cast<int>(std::min<int64_t>(n * p + 1, std::max(args->num_blocks, 1)));
  if (lf) {
    const auto kernel = logfmt_narrow(n, blocks, static_cast<int>(args->hidden))
                            ? combine<NvlNet, false, false, false, false, false, false, false, false, true>
                            : combine<NvlNet, false, false, false, false, false, false, true>;
    kernel<<<blocks, kReduceThreads, 0, deep_ep::as_stream(stream)>>>(*ctx, *args, DEK_LL_PHASE_RECV);
  } else {
    launch_combine(ctx, args, blocks, kReduceThreads, DEK_LL_PHASE_RECV, stream);
  }
  return static_cast<int>(cudaGetLastError());
}

namespace {
// The arguments of a one-launch combine (dek_ll_combine, dek_ll_combine_local): no overlap signal
// or seam (LogFMT: dek_ll_combine only, one_launch_logfmt_ok).
bool one_launch_combine_ok(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args) {
  return ll_ok(ctx, args) && args->src_info != nullptr && args->layout_range != nullptr && (args->zero_copy || args->x != nullptr) &&
         (args->num_tokens <= 0 || (args->out != nullptr && args->topk_idx != nullptr && args->topk_weights != nullptr)) &&
         args->signal == nullptr && args->net == nullptr;
}
// The one-launch LogFMT combine's (dek_ll_combine with DEK_LL_FLAG_LOGFMT): the send's layout
// check, and a grid of one block per SM.
bool one_launch_logfmt_ok(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args) { return logfmt_layout_ok(args) && ctx->num_sms > 0; }
// Its send form: spread from kLogfmtSpreadFrom selections (as the two-launch send's, logfmt_spread)
// where the scan holds every item (kOneLaunchSpreadItems), else an item per half block.
bool one_launch_logfmt_spread(const dek_ll_args_t* args) { return logfmt_spread(*args) && args->num_experts <= kOneLaunchSpreadItems; }
// A one-launch grid of at least `blocks`, widened to kBothBlocksPerSm per SM (all resident).
int resident_grid(const dek_ic_ctx_t* ctx, int blocks) {
  return ctx->num_sms > 0 && kBothBlocksPerSm * ctx->num_sms > blocks ? kBothBlocksPerSm * ctx->num_sms : blocks;
}
}  // namespace

extern "C" int dek_ll_combine(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (!one_launch_combine_ok(ctx, args)) return static_cast<int>(cudaErrorInvalidValue);
  if (args->flags & DEK_LL_FLAG_LOGFMT) {
    // One block of kReduceThreads per SM, all resident (the kernel's bound: 128 registers), each
    // half block sending an item at a time (or every warp its share of the rows: the spread form),
    // then receiving: no second launch, no recv_state.
    if (!one_launch_logfmt_ok(ctx, args)) return static_cast<int>(cudaErrorInvalidValue);
    const auto kernel = one_launch_logfmt_spread(args) ? combine<LsaNet, false, true, true, false, false, false, false, false, true>
                                                       : combine<LsaNet, false, true, false, false, false, false, false, false, true>;
    return launch_pdl(kernel, ctx->num_sms, kReduceThreads, deep_ep::as_stream(stream), *ctx, *args, static_cast<int>(DEK_LL_PHASE_BOTH));
  }
  // The send grid as one dimension: E blocks (per-expert rows), or num_blocks (partial sums).
  const int blocks = args->partial ? (args->num_blocks > ctx->num_ranks ? args->num_blocks : ctx->num_ranks) : args->num_experts;
  // One rank only: with a peer it was bit-exact but 1.2-1.4 µs slower at 128 tokens than the
  // per-item send (2 ranks, bench/NOTES.md session 29; +4 with the own rows read in place, session
  // 35); at one rank it runs only when the library chose this peer path over
  // dek_ll_combine_local (DEEP_EP_LL_LOCAL=peer).
  const int64_t selections = ll_selections(*args);
  const bool many = selections >= kSpreadMinSelections;
  if (ctx->num_ranks == 1 && !args->partial && many) {
    // Its work does not follow the grid: 3 blocks per SM, all resident (112 registers: 4 would fit;
    // the caller checked E <= 3 x SMs for the E-block grid).
    return launch_pdl(combine<NvlNet, false, true, true>, resident_grid(ctx, blocks), kLlThreads, deep_ep::as_stream(stream), *ctx, *args,
                      static_cast<int>(DEK_LL_PHASE_BOTH));
  }
  // Rows: the rows-only kernel (8 loads in flight), not where it was 0.17 µs slower (session 31, 32 tokens x top-8).
  if (!args->partial && (selections < kRowsSharedFrom || many)) {
    // From kSpreadMinSelections on, 3 blocks per SM (all resident) when E is fewer: the extra
    // blocks only receive, so a token's reduce splits over more blocks (P = blocks / N).
    return launch_pdl(combine<NvlNet, false, true, false, false, true>, many ? resident_grid(ctx, blocks) : blocks, kLlThreads,
                      deep_ep::as_stream(stream), *ctx, *args, static_cast<int>(DEK_LL_PHASE_BOTH));
  }
  return launch_pdl(args->partial ? combine<NvlNet, false, true, false, false, false, true> : combine<NvlNet, false, true>, blocks, kLlThreads,
                    deep_ep::as_stream(stream), *ctx, *args, static_cast<int>(DEK_LL_PHASE_BOTH));
}

extern "C" int dek_ll_combine_local(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (!one_launch_combine_ok(ctx, args) || ctx->num_ranks != 1) return static_cast<int>(cudaErrorInvalidValue);
  if (args->flags & DEK_LL_FLAG_LOGFMT) {
    // LogFMT (rows of x only, whole groups): a block per (token, chunk) item at a time, at most
    // kLfLocalBlocksPerSm per SM.
    if (args->partial || args->zero_copy || args->x == nullptr || args->hidden % deep_ep::logfmt::kGroup != 0)
      return static_cast<int>(cudaErrorInvalidValue);
    const int64_t chunk = deep_ep::logfmt::chunk_channels(static_cast<int>(args->hidden));
    const int64_t items = static_cast<int64_t>(args->num_tokens) * ((args->hidden + chunk - 1) / chunk);
    const int64_t cap = ctx->num_sms > 0 ? kLfLocalBlocksPerSm * static_cast<int64_t>(ctx->num_sms) : 1;
    const int blocks = static_cast<int>(items < 1 ? 1 : items < cap ? items : cap);
    return launch_pdl(combine<NvlNet, false, true, false, true, false, false, false, false, false, true>, blocks, kLfLocalThreads,
                      deep_ep::as_stream(stream), *ctx, *args, static_cast<int>(DEK_LL_PHASE_BOTH));
  }
  // A token's H/1024 slices on blocks of their own (8 rows' loads in flight per thread), at most
  // 3 blocks per SM (the one-launch instantiations' bound).
  const int64_t slices = static_cast<int64_t>(args->num_tokens) * ((args->hidden / 8 + kLlThreads - 1) / kLlThreads);
  const int64_t cap = ctx->num_sms > 0 ? kBothBlocksPerSm * static_cast<int64_t>(ctx->num_sms) : 1;
  const int blocks = static_cast<int>(slices < 1 ? 1 : slices < cap ? slices : cap);
  return launch_pdl(combine<NvlNet, false, true, false, true>, blocks, kLlThreads, deep_ep::as_stream(stream), *ctx, *args,
                    static_cast<int>(DEK_LL_PHASE_BOTH));
}

extern "C" int dek_ll_zero_signals(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream) {
  if (!ll_ok(ctx, args)) return static_cast<int>(cudaErrorInvalidValue);
  // The seam's instance of the signal reset (the LSA one also serves intranode buffers).
  const bool gin = args->net != nullptr && args->net_kind == DEK_LL_NET_GIN;
  auto* k = gin ? clean_signals<GinNet> : clean_signals<LsaNet>;
  k<<<16, 256, 0, deep_ep::as_stream(stream)>>>(*ctx, *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" size_t dek_ll_args_bytes(void) { return sizeof(dek_ll_args_t); }

// The GIN seam descriptor (GinNet) built on the host from `num_comms` device comms (byte copies of
// the ncclDevComm that ncclDevCommCreate returned with GIN, each of devcomm_bytes) and the window's
// ncclWindow_t on each communicator, into `out` (host memory of out_bytes); the caller copies it to
// Args::net in its own window. Contexts per communicator = the fewest any of them was granted.
// Returns the bytes written, 0 on bad arguments (a device comm without GIN included).
extern "C" size_t dek_ll_gin_net_build(const void* const* devcomms, size_t devcomm_bytes, void* const* windows,
                                            int num_comms, void* out, size_t out_bytes) {
  if (devcomms == nullptr || windows == nullptr || num_comms < 1 || num_comms > DEK_TP_MAX_GIN_COMMS ||
      devcomm_bytes < sizeof(ncclDevComm) || out == nullptr || out_bytes < sizeof(GinNet) ||
      reinterpret_cast<uintptr_t>(out) % alignof(GinNet) != 0)
    return 0;
  std::memset(out, 0, sizeof(GinNet));
  GinNet* n = static_cast<GinNet*>(out);
  int contexts = DEK_TP_MAX_GIN_CONTEXTS;
  for (int i = 0; i < num_comms; ++i) {
    if (devcomms[i] == nullptr || windows[i] == nullptr) return 0;
    std::memcpy(&n->c[i].comm, devcomms[i], sizeof(ncclDevComm));
    n->c[i].win = static_cast<ncclWindow_t>(windows[i]);
    const int granted = n->c[i].comm.ginContextCount;
    if (granted < 1) return 0;
    if (granted < contexts) contexts = granted;
  }
  n->num_comms = num_comms;
  n->num_contexts = contexts;
  return sizeof(GinNet);
}

// Layout of GinNet: which = 0 sizeof, 1 alignof, 2 offset of c[0].win, 3 stride of c[], 4 offset
// of num_comms, 5 offset of num_contexts, 6 capacity of c[].
extern "C" size_t dek_ll_gin_net_layout(int which) {
  alignas(GinNet) static unsigned char probe[sizeof(GinNet)];
  const GinNet* n = reinterpret_cast<const GinNet*>(probe);
  const auto off = [&](const void* p) { return static_cast<size_t>(static_cast<const unsigned char*>(p) - probe); };
  switch (which) {
    case 0: return sizeof(GinNet);
    case 1: return alignof(GinNet);
    case 2: return off(&n->c[0].win);
    case 3: return sizeof(deep_ep::tp::GinComm);
    case 4: return off(&n->num_comms);
    case 5: return off(&n->num_contexts);
    case 6: return DEK_TP_MAX_GIN_COMMS;
    default: return 0;
  }
}

// gin_route on the host, so the Rust route can be checked against the device's.
extern "C" void dek_ll_gin_route(int unit, int comms, int contexts, int* comm, int* context) {
  deep_ep::tp::gin_route(unit, comms, contexts, comm, context);
}
