// global_barrier.cu: the barrier of every rank of an internode buffer whose ctx holds only the
// windows of its own NVLink domain (ctx.nvl_ranks = D > 0): destroy_buffer and the barriers around
// a low-latency signal reset meet here instead of at the intranode flag barrier, which writes into
// every rank's window. Protocol and area: deep_ep_kernels.h ("Global barrier of an internode
// buffer"); the seam is the transport of kernels/transport.cuh, described in this rank's window.
#include <cstdint>

#include "intranode.cuh"
#include "transport.cuh"

namespace deep_ep {
namespace gb {
namespace {

using ic::at;
using ic::Ctx;
using ic::local;
using ic::window;

constexpr uint64_t kHeader = DEK_GB_OFF;
constexpr uint64_t kEpoch = DEK_GB_OFF + 64;
constexpr uint64_t kSignals = DEK_GB_SIG_OFF;
constexpr uint64_t kSlots = DEK_GB_SLOTS_OFF;
constexpr int kMaxDomains = DEK_GB_MAX_DOMAINS;
static_assert(ic::kScrEnd <= DEK_GB_OFF, "global barrier area overlaps the intranode scratch");
static_assert(sizeof(dek_gb_header_t) <= 64, "header overlaps the epoch");
static_assert(kSignals == kHeader + 128 && kSignals + 8 * kMaxDomains <= kSlots, "signal table overlaps the slots");
static_assert(kSlots + 8 * ic::kMaxRanks <= DEK_GB_DESC_OFF, "node slots overlap the descriptor");
static_assert(DEK_GB_DESC_OFF + DEK_GB_DESC_BYTES <= DEK_IC_CONTROL_BYTES - 1024, "descriptor reaches the LL scratch");
static_assert(sizeof(tp::LsaNet) <= DEK_GB_DESC_BYTES && sizeof(tp::GinNet) <= DEK_GB_DESC_BYTES, "descriptor too large");
static_assert(ic::kMaxRanks <= 32 && kMaxDomains <= 32, "one lane per local rank and per domain");

// Warp-collective barrier of epoch `e`. False after a timeout (reported, naming the rank).
template <class Net>
__device__ bool barrier(const Ctx& c, const Net& net, int signal_base, uint64_t e, int site) {
  const int lane = threadIdx.x & 31;
  const int D = c.nvl_ranks, Rr = c.num_ranks / D, node = c.rank / D, me = c.rank % D;
  // Node phase: epoch e into slot `me` of every window of the domain (own included), then every
  // slot of the own window up to e. Epochs only grow and no rank gets a barrier ahead of a peer
  // still waiting in this one, so `>=` is exact.
  __threadfence_system();  // this rank's earlier stores (stream order) before its arrival
  __syncwarp();
  if (lane < D) st_release_sys(at<uint64_t>(window(c, node * D + lane), kSlots + 8ull * me), e);
  bool ok = true;
  if (lane < D) ok = ic::wait_epoch(c, at<const uint64_t>(local(c), kSlots + 8ull * lane), e, node * D + lane, site);
  if (!__all_sync(0xffffffffu, ok)) return false;
  // Seam phase: the whole domain arrived; one add to signal `signal_base + node` of the rail peer
  // in every other domain, then a wait for each of theirs (sent after their own node phase), so
  // every rank of the buffer has arrived when the last one is in. A rank signals on the context
  // of its own rank, as the LL kernels put and signal on, so on GIN the barrier's signal reaches a
  // peer after this rank's earlier operations towards it on that context. Each barrier adds 1:
  // after barrier e a peer's signal holds e (GIN signals are never reset; waits are rolling).
  const auto t = net.at(c.rank);
  if (lane < Rr && lane != node) t.signal(lane * D + me, signal_base + node, 1);
  t.flush(lane);
  if (lane < Rr && lane != node) {
    const int peer = lane * D + me;
    const tp::Deadline dl(c.timeout_ns);
    uint64_t seen = 0;
    if (!net.at(peer).wait_signal(signal_base + lane, e, dl, &seen)) {
      ic::report(c, DEK_IC_ERR_TIMEOUT, peer, site, static_cast<int>(seen), static_cast<int>(e));
      ok = false;
    }
  }
  return __all_sync(0xffffffffu, ok);
}

}  // namespace

__global__ void __launch_bounds__(32) global_barrier(const __grid_constant__ Ctx c, int site) {
  // A buffer with a timed-out barrier waits for nobody any more (as the intranode barrier); the
  // host raises the recorded timeout.
  if (ld_volatile(at<const int>(local(c), ic::kScrTimedOut)) != 0) return;
  const dek_gb_header_t h = *at<const dek_gb_header_t>(local(c), kHeader);
  uint64_t e = 0;
  if (threadIdx.x == 0) {
    uint64_t* p = at<uint64_t>(local(c), kEpoch);
    e = *p + 1;
    *p = e;
  }
  e = __shfl_sync(0xffffffffu, e, 0);
  const char* desc = local(c) + DEK_GB_DESC_OFF;
  if (h.net_kind == DEK_LL_NET_GIN) {
    barrier(c, *reinterpret_cast<const tp::GinNet*>(desc), h.signal_base, e, site);
  } else if (h.net_kind == DEK_LL_NET_LSA) {
    barrier(c, *reinterpret_cast<const tp::LsaNet*>(desc), h.signal_base, e, site);
  } else if (threadIdx.x == 0) {
    ic::report(c, DEK_IC_ERR_MISMATCH, c.rank, site, h.net_kind, 0);  // never set up: a host bug
  }
}
}  // namespace gb
}  // namespace deep_ep

extern "C" int dek_gb_barrier(const dek_ic_ctx_t* ctx, int site, void* stream) {
  using namespace deep_ep;
  if (!ic::ctx_domain_ok(ctx) || ctx->nvl_ranks == 0 || ctx->num_ranks / ctx->nvl_ranks > gb::kMaxDomains)
    return cudaErrorInvalidValue;
  gb::global_barrier<<<1, 32, 0, as_stream(stream)>>>(*ctx, site);
  return cudaGetLastError();
}

// Layout constants for the Rust mirror's check (src/ffi/global_barrier.rs): 0 area offset, 1 LSA
// signal table, 2 descriptor offset, 3 descriptor bytes, 4 sizeof(LsaNet), 5 sizeof(GinNet),
// 6 most domains; 0 for anything else.
extern "C" size_t dek_gb_layout(int which) {
  switch (which) {
    case 0: return DEK_GB_OFF;
    case 1: return DEK_GB_SIG_OFF;
    case 2: return DEK_GB_DESC_OFF;
    case 3: return DEK_GB_DESC_BYTES;
    case 4: return sizeof(deep_ep::tp::LsaNet);
    case 5: return sizeof(deep_ep::tp::GinNet);
    case 6: return DEK_GB_MAX_DOMAINS;
    default: return 0;
  }
}
