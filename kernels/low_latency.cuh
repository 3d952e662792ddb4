// low_latency.cuh: what the low-latency kernels (ll_dispatch.cu, low_latency.cu) share: area
// offsets, call numbers and tags, the send prologue / epilogue, waits, the rank mask.
// Protocol, area layout and tags: deep_ep_kernels.h ("Low-latency mode"); the CPU backend
// (src/backend/cpu/ll.rs) defines the same results, bit for bit.
//
// Memory model: payload goes out with plain NVLink stores; every thread that stored fences at
// system scope, the block meets at __syncthreads, and one thread release-stores the signal word
// (st.release.sys). Receivers poll with ld.acquire.sys, meet at __syncthreads and read payload
// through L2 (__ldcg): the lines were never in this SM's L1 during the kernel.
//
// Internode (Args::net set): peers outside the caller's NVLink domain are reached through the
// transport seam (transport.cuh) by the helpers at the end of this file: send_to (a row), put_to,
// raise_to (a signal), wait_from (a wait); peers inside keep the NVLink stores. Kernels are
// templates over the seam (LsaNet: the NVLink emulation; GinNet: NCCL GIN), chosen at launch.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "intranode.cuh"
#include "transport.cuh"

namespace deep_ep {
// The low-latency kernels have a namespace of their own; they build on the intranode window
// helpers (Ctx, window(), the status block) of `ic`.
namespace ll {
using namespace ::deep_ep::ic;
namespace {

// Combine-send and dispatch-receive kernels: small blocks so that every block of a call is
// resident at once; the combine receive reduces with large blocks. The dispatch send uses
// kSendThreads per block, one block per few tokens (the warps split a token's channels).
constexpr int kLlThreads = 128;
// Blocks per SM of the one-launch combines (their launch bound; the grids that must be resident are
// capped at this many per SM).
constexpr int kBothBlocksPerSm = 3;
constexpr int kLlWarps = kLlThreads / 32;
constexpr int kReduceThreads = 512;
// A LogFMT combine send without Args::signal: 8 warps per (expert, rank) block (its encode is
// latency-bound; 4 warps per block left ~6 warps per SM: ncu, session 39). Within kReduceThreads,
// the bound of the kernel that launches it.
constexpr int kLogfmtSendThreads = 256;
// Below this many selections of the handle's dispatch (N·K, which the host passes in the send's
// Args) the LogFMT send runs kLlThreads blocks: E = 288 blocks of 256 threads do not fit at once
// (2 per SM at the kernel's 128 registers). At 1 token (bench/NOTES.md session 40): raw chunks
// -1.8 µs, cast chunks +1.0 (a row's 7 chunks on 4 warps take two rounds).
constexpr int64_t kLogfmtWideFrom = 64;
constexpr int kLogfmtSendWarps = kLogfmtSendThreads / 32;
static_assert(kLogfmtSendThreads <= kReduceThreads && kLogfmtSendThreads >= kLlThreads, "a LogFMT send block: within the bound, at least a kLlThreads block");
constexpr int kSendThreads = 256;
constexpr int kSendWarps = kSendThreads / 32;
constexpr int kMaxLlRanks = DEK_IN_MAX_RANKS;  // per-rank tables of the LL kernels (docs/RANKS.md)
constexpr int kDstWarps = rank_workers(kSendWarps);  // dispatch send: warps taking turns over destinations
// Instrument (cargo feature ll-stamps, bench/ll_stamps.py): thread 0 of a block writes the
// %globaltimer into stamp i < kLlStamps of its block (shared memory); the dispatch kernel prints
// them at its end. Compiled out otherwise.
constexpr int kLlStamps = 19;
__device__ __forceinline__ unsigned long long* ll_stamps() {
  __shared__ unsigned long long s_stamps[kLlStamps];
  return s_stamps;
}
#ifdef DEEP_EP_LL_STAMPS
#define LL_STAMP(i) (threadIdx.x == 0 ? (void)(ll_stamps()[i] = globaltimer()) : (void)0)
// The same, once register r holds its value (an empty asm that reads it orders the timer after).
#define LL_STAMP_AFTER(i, r)                 \
  do {                                       \
    if (threadIdx.x == 0) {                  \
      asm volatile("" ::"r"(r));             \
      ll_stamps()[i] = globaltimer();        \
    }                                        \
  } while (0)
#else
#define LL_STAMP(i) ((void)0)
#define LL_STAMP_AFTER(i, r) ((void)0)
#endif

// Programmatic dependent launch (the one-rank forms, launch_pdl): the kernel is launched before
// the one ahead of it in the stream has finished; `pdl_wait` holds it until that grid has
// completed and its stores are visible (so nothing may read or write global memory before it),
// `pdl_trigger` lets the next such kernel be launched now, to wait in its own `pdl_wait`. Both
// are no-ops in a kernel launched without the attribute, and before sm_90 (where the attribute
// does nothing either). The library embeds SASS only (build.rs: code=sm_X, no PTX), so no GPU of
// sm_90 or later runs a JIT of code compiled below it, which would launch early without the wait.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Launches `kernel` with programmatic stream serialization (its start overlaps the end of the
// kernel before it; the kernel must begin with pdl_wait). Returns cudaGetLastError() as the
// <<<>>> launches' callers do.
template <class... P, class... A>
inline int launch_pdl(void (*kernel)(P...), int blocks, int threads, cudaStream_t stream, A&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
  return static_cast<int>(cudaGetLastError());
}

// Most experts of a dispatch send (two int histograms of E in shared memory).
constexpr int kMaxLlExperts = DEK_LL_MAX_EXPERTS;
// LL words of the control area's scratch (local only): the call counter and the "blocks done"
// counter of the send kernels (the last block advances the call counter and resets this one).
constexpr size_t kLlCalls = DEK_IC_CONTROL_BYTES - 1024;  // after the push-dispatch flags
constexpr size_t kLlDone = kLlCalls + 4;
static_assert(kScrEnd <= kLlCalls, "LL scratch overlaps the normal-mode scratch");
static_assert(kLlDone + 4 <= DEK_IC_CONTROL_BYTES, "LL scratch outside the control area");
static_assert(ic::kScrEnd <= DEK_IC_RANK_TABLES_OFF && DEK_IC_RANK_TABLES_END <= DEK_GB_OFF, "rank tables overlap the scratch areas");
// Format words every NVLink source leaves in a receiver's control area with each send, before its
// signals: [kind (0 dispatch, 1 combine)][half][source rank][flags, hidden, T, E] (by half: a
// sender may run one call ahead, into the other half, with other flags). The receiver compares
// them with its own after the wait, so ranks passing other flags or another geometry raise
// (DEK_IC_ERR_LL_FORMAT at the next call) instead of reading each other's bytes as their own.
// In the rank tables (deep_ep_kernels.h), indexed by world rank.
constexpr size_t kLlFmt = DEK_LL_FMT_OFF;
__device__ __forceinline__ size_t fmt_slot(int kind, int half, int src) { return kLlFmt + static_cast<size_t>(((kind * 2 + half) * DEK_IN_MAX_RANKS + src) * 16); }
constexpr uint32_t kFmtSet = 0x100;  // a written slot (a zeroed one never matches)

// Routing fingerprints (local only), u64 [8]: [h] = the topk_idx of the latest dispatch sent on
// half h, [2 + h] = the one the combine sent on half h answers (0 = unknown: no check); [4 + h] =
// the top-k weights that dispatch carried (0 = none), [6 + h] = those of the combine's dispatch when
// the combine sends partial sums (made with them). A dispatch send writes [h] and [4 + h]; a combine
// send copies [routing_half] to [2 + half] (and [4 + routing_half] to [6 + half]); the combine
// receive compares its own topk_idx (and topk_weights) with them (DEK_IC_ERR_LL_ROUTING, extra 0 for
// the ids, 1 for the weights), as the CPU backend.
constexpr size_t kLlRouting = kLlCalls + 128;
static_assert(kLlRouting % 8 == 0 && kLlRouting + 64 <= DEK_IC_CONTROL_BYTES, "LL routing fingerprints");
static_assert(DEK_LL_OWN_STATE_OFF >= kLlRouting + 64 && DEK_LL_OWN_STATE_OFF + 64 <= DEK_IC_CONTROL_BYTES, "LL own recv_state");

// One top-k entry's share of a routing fingerprint: entry j (= token * K + k) holding expert id e.
// The fingerprint is the sum over entries (any thread order gives the same) sealed with N and K.
__device__ __forceinline__ uint64_t routing_mix(int64_t j, int64_t e) {
  uint64_t z = (static_cast<uint64_t>(j) << 32) ^ static_cast<uint64_t>(e + 1) ^ 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ uint64_t routing_seal(uint64_t sum, int n, int k) {
  return (sum + routing_mix(-1, (static_cast<int64_t>(n) << 8) | k)) | 1;  // never 0 (= unknown)
}

using Args = dek_ll_args_t;
// The call's top-k selections N·K (a combine's: its handle's dispatch's, recorded by the host):
// what the send and receive forms are chosen by.
__host__ __device__ __forceinline__ int64_t ll_selections(const Args& a) { return static_cast<int64_t>(a.num_tokens) * a.num_topk; }

// The LogFMT combine send spreads its rows over the grid (combine_send_logfmt_spread, a 1-D grid of
// kLogfmtSpreadBlocksPerSm blocks per SM) from kLogfmtSpreadFrom selections of the handle's
// dispatch on (N·K: the host passes that dispatch's num_tokens and num_topk in the send's Args).
// Below, one block per (expert, rank) item. Measured at 2 ranks (bench/NOTES.md session 40): on
// cast chunks, where a unit's encode is long and the heaviest item set the send's time, -8 µs at
// 32 tokens and -20 at 128; on raw chunks (amax >= 1) +3 and +4 (not measured apart: the scan,
// the completion counters, the store order). Not with overlap signals or a seam. Launcher and kernel
// decide alike.
constexpr int64_t kLogfmtSpreadFrom = DEK_LL_LOGFMT_SPREAD_FROM;
constexpr int kLogfmtSpreadBlocksPerSm = 2;  // 256 threads at the kernel's 128 registers: the SM's register file
__host__ __device__ __forceinline__ bool logfmt_spread(const Args& a) {
  return (a.flags & DEK_LL_FLAG_LOGFMT) != 0 && a.signal == nullptr && a.net == nullptr && ll_selections(a) >= kLogfmtSpreadFrom;
}

__device__ __forceinline__ uint64_t sig_off(const Args& a, int h) { return a.ll_off + h * a.signal_bytes; }
__device__ __forceinline__ uint64_t send_off(const Args& a, int h) { return a.ll_off + 2 * a.signal_bytes + h * a.send_bytes; }
__device__ __forceinline__ uint64_t recv_off(const Args& a, int h) {
  return a.ll_off + 2 * (a.signal_bytes + a.send_bytes) + h * a.recv_bytes;
}

// acc[2u], acc[2u + 1] = fma(the low / high bf16 of wv[u], wt, acc): one weighted row piece of a
// combine, in the fixed order of the calls.
__device__ __forceinline__ void fma_bf16x8(float (&acc)[8], const uint32_t (&wv)[4], float wt) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    acc[2 * u] = __fmaf_rn(bf16_to_f32(wv[u] & 0xffffu), wt, acc[2 * u]);
    acc[2 * u + 1] = __fmaf_rn(bf16_to_f32(wv[u] >> 16), wt, acc[2 * u + 1]);
  }
}

// The call after `calls` (16 bits travel in a tag; 0 is skipped so a zeroed word never matches).
__device__ __forceinline__ uint32_t next_seq(uint32_t calls) {
  uint32_t s = calls + 1;
  if ((s & 0xffffu) == 0) s += 1;
  return s;
}
__device__ __forceinline__ uint32_t tag(uint32_t seq, uint32_t count) { return ((seq & 0xffffu) << 16) | (count + 1); }
// Count field of the tag of a call its sender gave up (deep_ep_kernels.h, "Abandoned calls"; the
// CPU backend's ll_tags.rs): never a count, as T <= DEK_LL_MAX_TOKENS keeps count + 1 below it.
constexpr uint32_t kAbandoned = 0xffffu;
__device__ __forceinline__ uint32_t abandoned_tag(uint32_t seq) { return ((seq & 0xffffu) << 16) | kAbandoned; }
// What a signal value says about call `seq`: 1 = its tag arrived, -1 = its sender gave it up, 0 = neither.
__device__ __forceinline__ int tag_state(uint32_t v, uint32_t seq) {
  if ((v >> 16) != (seq & 0xffffu) || (v & 0xffffu) == 0) return 0;
  return (v & 0xffffu) == kAbandoned ? -1 : 1;
}
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
    // Written whatever happens (the op allocates it uninitialised: no memset node per call); a
    // skipped send leaves kind -1, which no receive accepts. NULL: a one-launch dispatch.
    if (blockIdx.x == 0 && blockIdx.y == 0 && a.recv_state != nullptr) {
      a.recv_state[0] = a.half;
      a.recv_state[1] = *s_seq;
      a.recv_state[2] = a.flags;
      a.recv_state[3] = *s_skip ? -1 : kind;
    }
    // The dispatch's fingerprints copied for the receive launch's routing check (check_routing:
    // a later dispatch may reuse the words before a hook runs). A one-launch combine (no
    // recv_state) reads the dispatch's words itself (check_routing_direct): no copy, whose load
    // waited for the timed-out word's on block 0's path to its first barrier.
    if (!*s_skip && blockIdx.x == 0 && blockIdx.y == 0 && a.recv_state != nullptr) {
      if (kind == DEK_LL_KIND_COMBINE) {
        uint64_t* fp = at<uint64_t>(local(c), kLlRouting);
        const bool known = a.routing_half == 0 || a.routing_half == 1;
        fp[2 + a.half] = known ? fp[a.routing_half] : 0;
        fp[6 + a.half] = known && a.partial ? fp[4 + a.routing_half] : 0;
      }
    }
  }
  __syncthreads();
  return !*s_skip;
}

// The call's end (one thread of a send kernel): the call counter advanced to `seq` and the ticket
// word reset, read by the next call's kernels (begin_send; the kernel boundary orders them).
__device__ __forceinline__ void end_call(const Ctx& c, uint32_t seq) {
  *at<volatile int>(local(c), kLlCalls) = static_cast<int>(seq);
  *at<volatile unsigned int>(local(c), kLlDone) = 0;
}

// End of a send kernel: the last block to finish advances the call counter (every block read the
// old value before counting itself done).
__device__ void finish_send(const Ctx& c, uint32_t seq) {
  if (threadIdx.x == 0) {
    unsigned int* done = at<unsigned int>(local(c), kLlDone);
    __threadfence();
    if (atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1) {
      end_call(c, seq);
      __threadfence();
    }
  }
}

// The rank mask (device copy of the host's mask, int32 words, 1 = masked); NULL = nobody masked.
__device__ __forceinline__ bool rank_masked(const Args& a, int r) {
  return a.mask != nullptr && *reinterpret_cast<const volatile int32_t*>(a.mask + r) != 0;
}

// Shrink mode: marks rank r dead in the kernels' device copy and in the host-mapped block (which
// the mask query reads), so this and every later LL call skips it. True for the one thread that
// masked it first (it gives the call up at r: abandon_call).
__device__ bool mask_rank(const Args& a, int r) {
  const bool first = a.mask == nullptr || atomicExch(const_cast<int32_t*>(a.mask) + r, 1) == 0;
  *reinterpret_cast<volatile int32_t*>(a.shrink_mask + r) = 1;
  __threadfence_system();
  return first;
}

// The end of a wait whose deadline passed (waiting for `about_rank`, last value seen `v`): shrink
// mode masks the rank (0), else the buffer times out (reported: -1). *gave_up: this thread decided
// first (masked the rank, or timed the buffer out), so it gives the call up (abandon_call).
__device__ int wait_deadline(const Ctx& c, const Args& a, int about_rank, int site, int v, int limit, bool* gave_up) {
  if (a.shrink_mask != nullptr) {
    *gave_up = mask_rank(a, about_rank);
    return 0;
  }
  *gave_up = atomicCAS(at<int>(local(c), kScrTimedOut), 0, 1) == 0;
  report(c, DEK_IC_ERR_TIMEOUT, about_rank, site, v, limit);
  return -1;
}

// A wait found call `seq`'s abandoned tag from `about_rank` (reported whatever the mask: the
// tokens of a call their sender gave up are never delivered). Sticky like a timeout: this rank's
// calls are out of step with its peers', so later calls skip and the host keeps the error.
__device__ int wait_abandoned(const Ctx& c, int about_rank, uint32_t seq, int site) {
  atomicExch(at<int>(local(c), kScrTimedOut), 1);
  report(c, DEK_IC_ERR_LL_ABANDONED, about_rank, site, static_cast<int>(seq & 0xffffu), 0);
  return -1;
}

// Waits until `word` holds a tag of call `seq` sent by `about_rank`: 1 = arrived (*value set);
// 0 = the rank is masked (shrink mode: by this wait at its deadline, or meanwhile by another
// block's); -1 = timed out (reported, the buffer is unusable; shrink mode off) or the sender gave
// the call up (DEK_IC_ERR_LL_ABANDONED). *gave_up as wait_deadline.
__device__ int wait_tag(const Ctx& c, const Args& a, const uint32_t* word, uint32_t seq, int about_rank, int site, uint32_t* value,
                        bool* gave_up) {
  const uint64_t start = globaltimer();
  for (uint32_t polls = 1;; ++polls) {
    const uint32_t v = ld_acquire_sys_u32(word);
    const int st = tag_state(v, seq);
    if (st > 0) {
      *value = v;
      return 1;
    }
    if (st < 0) return wait_abandoned(c, about_rank, seq, site);
    if (a.shrink_mask != nullptr && polls % 64 == 0 && rank_masked(a, about_rank)) return 0;
    if (globaltimer() - start > c.timeout_ns) return wait_deadline(c, a, about_rank, site, static_cast<int>(v), 0, gave_up);
  }
}

// Dispatch message (deep_ep_kernels.h): 16-byte header {src token, H, T, E}, 16 bytes {entries,
// has weights, 0, 0}, kMaxLlTopk u32 entries (local expert << 16 | expert slot, top-k order),
// kMaxLlTopk f32 weights, then the payload.
constexpr int kMaxLlTopk = DEK_LL_MAX_TOPK;
constexpr int kMsgMeta = 32 + 8 * kMaxLlTopk;
static_assert(kMsgMeta == DEK_LL_MSG_META, "message meta size");

// Reads recv_state: false (after reporting) when it does not come from a send of `kind` with
// `flags`, or the buffer timed out.
__device__ bool read_state(const Ctx& c, const Args& a, int kind, bool check_flags, int site, int* half, uint32_t* seq, int* flags) {
  // Every load issued before any test: one memory latency instead of five in a chain. Volatile
  // like the timed-out word's, so that they are made on the stale path too and stay above its test
  // (plain loads were moved below it: two latencies in a chain, the SASS of session 37).
  const bool stale = timed_out(c);
  const volatile int64_t* st = a.recv_state;
  const int64_t st0 = st[0], st1 = st[1], st2 = st[2], st3 = st[3];
  if (stale) return false;
  if (st3 != kind || (check_flags && st2 != a.flags) || st0 < 0 || st0 > 1) {
    report(c, DEK_IC_ERR_MISMATCH, c.rank, site, static_cast<int>(st3), kind);
    return false;
  }
  *half = static_cast<int>(st0);
  *seq = static_cast<uint32_t>(st1);
  *flags = static_cast<int>(st2);
  return true;
}

bool ll_net_ok(const Ctx* c, const Args* a);

// Host side of the launch functions: the arguments describe an LL area inside the window.
bool ll_ok(const Ctx* c, const Args* a) {
  if (!ctx_domain_ok(c) || a == nullptr) return false;
  // A ctx without the other domains' windows needs the seam for them (same domain size).
  if (c->nvl_ranks != 0 && (a->net == nullptr || a->nvl_domain != c->nvl_ranks)) return false;
  if (a->num_max_tokens < 1 || a->num_max_tokens > DEK_LL_MAX_TOKENS || a->hidden < 128 || a->hidden % 128 != 0) return false;
  if (a->num_experts < c->num_ranks || a->num_experts % c->num_ranks != 0 || a->half < 0 || a->half > 1) return false;
  if (a->num_topk < 0 || a->num_topk > kMaxLlTopk || a->num_tokens < 0 || a->num_tokens > a->num_max_tokens) return false;
  const uint64_t end = a->ll_off + 2 * (a->signal_bytes + a->send_bytes + a->recv_bytes);
  const uint64_t payload = a->hidden * 2 > a->hidden + a->hidden / 32 ? a->hidden * 2 : a->hidden + a->hidden / 32;
  const uint64_t rt = static_cast<uint64_t>(c->num_ranks) * a->num_max_tokens;
  const uint64_t msgs = a->msgs_off + rt * a->msg_bytes;
  // Partial rows must fit when a combine sends them (and lie after the messages).
  const bool partial_ok = !a->partial || (a->partial_off >= msgs && a->partial_off % 16 == 0 &&
                                           a->partial_off + rt * 2 * a->hidden <= a->recv_bytes &&
                                           a->dispatch_half >= 0 && a->dispatch_half <= 1);
  return a->ll_off % 128 == 0 && a->msg_bytes % 16 == 0 && a->signal_bytes % 16 == 0 && a->send_bytes % 16 == 0 &&
         a->recv_bytes % 16 == 0 && end <= c->window_bytes && a->signal_bytes * 8 >= 4ull * 8 * a->num_experts &&
         a->msg_bytes >= kMsgMeta + payload && a->idx_off >= 4ull * c->num_ranks && a->idx_off % 16 == 0 &&
         a->msgs_off >= a->idx_off + 4ull * a->num_experts * a->num_max_tokens && a->msgs_off % 16 == 0 &&
         msgs <= a->recv_bytes && partial_ok && ll_net_ok(c, a);
}

// ---- internode: peers outside the NVLink domain through the transport seam ------------------------
// The seam descriptor (tp::LsaNet / tp::GinNet, device memory at Args::net, in this rank's
// window, written at creation).
using tp::GinNet;
using tp::LsaNet;
using tp::NvlNet;
constexpr int kSeamDispatch = 0, kSeamCombine = 1;

template <class Net>
__device__ __forceinline__ const Net& net_of(const Args& a) { return *static_cast<const Net*>(a.net); }

// Warp-collective (every lane of the warp): the distinct ranks `d` of the lanes with `valid`,
// ascending (a token's destinations, the CPU backend's order): a valid lane's index among them
// (how many are smaller: the same in every lane of one rank), whether it is the lowest lane of its
// rank, and how many there are. No rank bitmask, so any rank up to kMaxLlRanks.
struct RankList {
  int idx;
  bool first;
  int count;
};
__device__ __forceinline__ RankList rank_list(bool valid, int d) {
  const int lane = threadIdx.x & 31;
  const unsigned same = __match_any_sync(0xffffffffu, valid ? d : -1 - lane);
  const bool first = valid && (same & ((1u << lane) - 1u)) == 0;
  const unsigned firsts = __ballot_sync(0xffffffffu, first);
  int idx = 0;
  for (unsigned f = firsts; f != 0; f &= f - 1) idx += __shfl_sync(0xffffffffu, d, __ffs(f) - 1) < d;
  return RankList{idx, first, __popc(firsts)};
}

// NvlNet kernels are the one-launch, one-rank and seamless two-launch forms, whose launchers refuse
// a seam and LogFMT: code for either is left out of them.
template <class Net>
constexpr bool kNvlOnly = std::is_same_v<Net, NvlNet>;

// Whether the kernel has peers behind a seam (Args::net); never for NvlNet, whatever `a` says.
template <class Net>
__device__ __forceinline__ bool has_seam(const Args& a) {
  return !kNvlOnly<Net> && a.net != nullptr;
}

// Whether peer d lies outside this rank's NVLink domain.
template <class Net>
__device__ __forceinline__ bool remote(const Ctx& c, const Args& a, int d) {
  return has_seam<Net>(a) && d / a.nvl_domain != c.rank / a.nvl_domain;
}

// Format flags of a dispatch (crate::backend::cpu::ll::format_code's bits) and of a combine.
__device__ __forceinline__ uint32_t fmt_dispatch(const Args& a) {
  return kFmtSet | (a.use_fp8 ? 1u | (a.round_scale ? 2u : 0u) | (a.use_ue8m0 ? 4u : 0u) : 0u) | (a.use_nvfp4 ? 8u : 0u);
}
__device__ __forceinline__ uint32_t fmt_combine(bool logfmt, bool partial) { return kFmtSet | (logfmt ? 1u : 0u) | (partial ? 2u : 0u); }

// Sender: this rank's format words in NVLink peer d's slot (before the fence that precedes the signals).
__device__ __forceinline__ void put_fmt(const Ctx& c, const Args& a, int kind, int d, uint32_t flags) {
  uint32_t* w = at<uint32_t>(window(c, d), fmt_slot(kind, a.half, c.rank));
  w[0] = flags;
  w[1] = static_cast<uint32_t>(a.hidden);
  w[2] = static_cast<uint32_t>(a.num_max_tokens);
  w[3] = static_cast<uint32_t>(a.num_experts);
}

// Receiver, after a wait on source s for the send into `half` succeeded: false (reported: field in extra, theirs, mine) when
// s sent with another format.
__device__ bool fmt_agrees(const Ctx& c, const Args& a, int kind, int half, int s, uint32_t flags, int site) {
  uint32_t w[4];  // the slot in one 16-byte volatile load (it is 16-aligned) instead of four in a chain
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "l"(at<const uint32_t>(local(c), fmt_slot(kind, half, s)))
               : "memory");  // after the wait's acquire load, as the volatile loads it replaces
  const uint32_t mine[4] = {flags, static_cast<uint32_t>(a.hidden), static_cast<uint32_t>(a.num_max_tokens), static_cast<uint32_t>(a.num_experts)};
  for (int i = 0; i < 4; ++i) {
    const uint32_t theirs = w[i];
    if (theirs != mine[i]) {
      report(c, DEK_IC_ERR_LL_FORMAT, s, site, static_cast<int>(theirs), static_cast<int>(mine[i]), i);
      return false;
    }
  }
  return true;
}

// Seam signal of (kind, half, local expert l, rank r): on a receiver r is the sender; in a sender's
// shadow table r is the receiver (crate::backend::nccl::ll_seam::signal_id).
__device__ __forceinline__ int seam_signal(const Args& a, int R, int kind, int half, int l, int r) {
  return ((kind * 2 + half) * (a.num_experts / R) + l) * R + r;
}

// One warp puts `bytes` from this rank's window at src_off to peer d's at dst_off. Everything a
// rank sends to one peer goes on the context of the sender's rank, so a signal covers all of it.
template <class Net>
__device__ __forceinline__ void put_to(const Ctx& c, const Args& a, int d, uint64_t dst_off, uint64_t src_off, uint64_t bytes, int lane) {
  net_of<Net>(a).at(c.rank).put(d, dst_off, src_off, bytes, 0, 0, lane);
}

// One warp sends `bytes` from `src` to peer d's window at dst_off: NVLink stores inside the domain;
// outside, a seam put from this rank's window at stage_off (src is copied there first unless it
// already lies there). The staged source must stay untouched until the warp's flush.
template <class Net, int kU = kUnroll>
__device__ void send_to(const Ctx& c, const Args& a, int d, uint64_t dst_off, const void* src, uint64_t stage_off, int64_t bytes, int lane) {
  if (!remote<Net>(c, a, d)) {
    warp_copy<kU>(window(c, d) + dst_off, src, bytes, lane);
    return;
  }
  char* st = local(c) + stage_off;
  if (st != src) {
    warp_copy(st, src, bytes, lane);
    __syncwarp();
  }
  put_to<Net>(c, a, d, dst_off, stage_off, static_cast<uint64_t>(bytes), lane);
}

// Sources of this warp's earlier puts may be reused (GIN); a no-op sync in the emulation.
template <class Net>
__device__ __forceinline__ void flush_net(const Ctx& c, const Args& a, int lane) {
  if (has_seam<Net>(a)) net_of<Net>(a).at(c.rank).flush(lane);
}

// One thread sets LL signal (kind, half, l) of peer d to tag v after every earlier store/put of
// this call to d it is ordered after: a release store of `word` (in d's window) inside the domain;
// outside, a seam signal add of v minus what this rank gave that signal last (its shadow), so the
// receiver finds exactly the tag, as in an NVLink word, and no signal is ever reset between calls.
template <class Net>
__device__ void raise_to(const Ctx& c, const Args& a, int d, uint32_t* word, int kind, int half, int l, uint32_t v) {
  if (!remote<Net>(c, a, d)) {
    st_release_sys_u32(word, v);
    return;
  }
  uint64_t* shadow = at<uint64_t>(local(c), a.shadow_off) + seam_signal(a, c.num_ranks, kind, half, l, d);
  const uint64_t add = static_cast<uint64_t>(v) - *shadow;
  *shadow = v;
  net_of<Net>(a).at(c.rank).signal(d, seam_signal(a, c.num_ranks, kind, half, l, c.rank), add);
}

// Waits until LL signal (kind, half, l) from `src` holds a tag of call `seq` (wait_tag for an
// NVLink word `word` in this rank's window; the seam signal of src outside the domain). Returns
// as wait_tag: 1 arrived, 0 src masked (shrink mode), -1 timed out (reported, naming src).
template <class Net>
__device__ int wait_from(const Ctx& c, const Args& a, int src, const uint32_t* word, int kind, int half, int l, uint32_t seq, int site,
                         uint32_t* value, bool* gave_up) {
  *gave_up = false;
  if (!remote<Net>(c, a, src)) return wait_tag(c, a, word, seq, src, site, value, gave_up);
  const auto t = net_of<Net>(a).at(src);
  const int sig = seam_signal(a, c.num_ranks, kind, half, l, src);
  const uint64_t start = globaltimer();
  for (uint32_t polls = 1;; ++polls) {
    const uint64_t v = t.read_signal(sig);
    const int st = (v >> 32) == 0 ? tag_state(static_cast<uint32_t>(v), seq) : 0;
    if (st > 0) {
      *value = static_cast<uint32_t>(v);
      return 1;
    }
    if (st < 0) return wait_abandoned(c, src, seq, site);
    if (a.shrink_mask != nullptr && polls % 64 == 0 && rank_masked(a, src)) return 0;
    if (globaltimer() - start > c.timeout_ns) {
      return wait_deadline(c, a, src, site, static_cast<int>(v), static_cast<int>(seq & 0xffffu), gave_up);
    }
  }
}

// Gives call `seq` (kind kSeamDispatch or kSeamCombine, half `half`) up after this rank's receive
// of it timed out: every signal this rank's send of that call set at rank `only` (shrink mode: the
// rank it masked) or at every unmasked peer (only < 0: the buffer timed out) now holds the call's
// abandoned tag, so a late peer whose same-numbered call pairs with it raises instead of taking
// its tokens (deep_ep_kernels.h, "Abandoned calls"). Dispatch: word l*R + rank of every local
// expert l of the peer; combine: words rank*E_l + l (partial sums: l = 0 only). One thread: the
// one that gave the call up (wait_from's *gave_up), so the seam signals' shadows have one writer.
template <class Net>
__device__ __noinline__ void abandon_call(const Ctx& c, const Args& a, int kind, int half, uint32_t seq, int only, bool partial) {
  const int R = c.num_ranks, El = a.num_experts / R, me = c.rank;
  const uint32_t v = abandoned_tag(seq);
  for (int d = 0; d < R; ++d) {
    if (d == me || (only >= 0 && d != only) || (only < 0 && rank_masked(a, d))) continue;
    char* peer = window(c, d);  // NULL outside the domain: raise_to signals through the seam
    const int words = kind == kSeamDispatch ? El : (partial ? 1 : El);
    for (int l = 0; l < words; ++l) {
      const uint64_t w = kind == kSeamDispatch ? static_cast<uint64_t>(l) * R + me : static_cast<uint64_t>(me) * El + l;
      uint32_t* word = peer != nullptr ? at<uint32_t>(peer, sig_off(a, half) + w * 4) : nullptr;
      raise_to<Net>(c, a, d, word, kind, half, l, v);
    }
  }  // no flush: signals only (the seam's flush is warp-collective and this is one thread)
}

// Host side: the seam fields of an LL call (none when net is NULL).
bool ll_net_ok(const Ctx* c, const Args* a) {
  if (a->net == nullptr) return true;
  const uint64_t R = c->num_ranks, E = a->num_experts, T = a->num_max_tokens;
  const uint64_t pay = a->msg_bytes - kMsgMeta;
  return (a->net_kind == DEK_LL_NET_LSA || a->net_kind == DEK_LL_NET_GIN) && a->nvl_domain >= 1 &&
         a->nvl_domain < c->num_ranks && c->num_ranks % a->nvl_domain == 0 && E <= kMaxLlExperts &&
         a->shadow_off % 8 == 0 && a->shadow_off + 8 * 4 * E <= c->window_bytes &&
         reinterpret_cast<uintptr_t>(a->net) % 16 == 0 && a->stage_meta_off % 16 == 0 && a->stage_idx_off % 16 == 0 &&
         a->stage_cnt_off % 16 == 0 && a->stage_meta_off >= T * pay && a->stage_idx_off >= a->stage_meta_off + R * T * kMsgMeta &&
         a->stage_cnt_off >= a->stage_idx_off + 4 * E * T && a->stage_cnt_off + 4 * R <= a->send_bytes;
}

}  // namespace
}  // namespace ll
}  // namespace deep_ep
