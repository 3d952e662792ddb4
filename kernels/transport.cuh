// transport.cuh: the device-side seam through which kernels talk to remote (RDMA-leg) peers.
//
// One interface, two implementations chosen by template parameter:
//   - LsaTransport: an emulation over NVLink (stores through peer window pointers, signals are
//     uint64 words in the receiver's window raised with red.release.sys). It lets one NVLink node
//     play several "nodes" (e.g. 2 x 2 GPUs on a 4-GPU machine) with the same kernel code.
//   - GinTransport: NCCL GPU-initiated networking (ncclGin of nccl_device/gin.h, NCCL >= 2.28.7):
//     one-sided puts on a registered window with a remote signal add, per-context signal tables.
//
// The contract kernels may rely on (the intersection of both):
//   - Peers are world ranks. Offsets are byte offsets into the one symmetric window: the source of
//     a put lies in the caller's own window (GIN can only send registered memory). Offsets and
//     sizes are multiples of 4 (of 16 for the emulation's full-speed copy).
//   - put(...) is warp-collective (all 32 lanes, same arguments). When `signal_add` > 0 the
//     peer's signal (in the same context) grows by that amount once the payload of this put, and
//     of every earlier put *of the calling warp* on this context to that peer, is visible to the
//     peer. (GIN orders all puts of a context; the emulation only the warp's own, so signal from
//     the warp that wrote the data.)
//   - signal(peer, s, add) (one thread) is a put's signal without payload: it covers the same
//     earlier puts (and, in the emulation, the stores the thread is ordered after).
//   - Signals are per context: a sender on context c raises signal s of the receiver's context c;
//     the receiver must read/wait with a transport on the same context. Values only grow (adds)
//     until reset; comparisons are rolling (wrap-safe), as NCCL's.
//   - wait_signal(...) is called by one thread, polls with acquire semantics, and gives up at the
//     globaltimer deadline, returning false with the last value seen; the caller reports which
//     rank it waited for (report_first below).
//   - reset_signal must not race with adds to that signal (both implementations).
//   - flush(...) (warp-collective): the sources of this warp's earlier puts may be reused.
//   - local(off): a plain pointer into the caller's own window.
#pragma once

#include <cstdint>

// NCCL's device headers trip -Wunused-parameter in the host pass; they are not ours to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <nccl.h>
#include <nccl_device.h>
#pragma GCC diagnostic pop

#include "common.cuh"
#include "transport_api.h"

namespace deep_ep {
namespace tp {
namespace {

static_assert(DEK_TP_MAX_GIN_CONTEXTS == NCCL_GIN_MAX_CONTEXTS, "GIN context limit changed in nccl_device");

// Rolling "least <= got" on 64 bits, as nccl::utility::rollingLessEq.
__device__ __forceinline__ bool reached(uint64_t least, uint64_t got) { return static_cast<int64_t>(got - least) >= 0; }

// A deadline on the global timer; `timeout_ns == 0` means "already expired after one poll".
struct Deadline {
  uint64_t at;
  __device__ explicit Deadline(uint64_t timeout_ns) : at(globaltimer() + timeout_ns) {}
  __device__ bool passed() const { return globaltimer() >= at; }
};

// The wait loop of every transport (one thread): polls `read()` until it reaches `least`
// (rolling), false once the deadline passed; the last value read goes to *seen.
template <class Read>
__device__ __forceinline__ bool poll_signal(Read read, uint64_t least, const Deadline& dl, uint64_t* seen) {
  for (uint32_t spin = 0;; ++spin) {
    const uint64_t v = read();
    *seen = v;
    if (reached(least, v)) return true;
    if ((spin & 63) == 63 && dl.passed()) return false;
  }
}

// Records the first error of a launch into the host-mapped status. `claim` is a device word the
// host zeroed (host-mapped memory has no atomics over PCIe, so the race is decided on the GPU).
__device__ void report_first(dek_tp_status_t* st, int* claim, int code, int peer, int signal, int context,
                             uint64_t seen, uint64_t expected) {
  if (st == nullptr || claim == nullptr || atomicCAS(claim, 0, code) != 0) return;
  volatile dek_tp_status_t* h = st;
  h->peer = peer;
  h->signal = signal;
  h->context = context;
  h->seen = seen;
  h->expected = expected;
  __threadfence_system();
  h->error = code;
  __threadfence_system();
}

// One warp copies `bytes` (a multiple of 4, 4-aligned ends) from src to dst: common.cuh's
// warp_copy16 (L2-only loads: the source may be written by peers between ops), 4 loads in flight,
// when both ends and the size are 16-byte multiples; 4-byte words otherwise (LL index rows and
// counts, rows of zero-copy combine buffers).
__device__ __forceinline__ void put_copy(char* dst, const char* src, uint64_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
    warp_copy16<4>(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src), static_cast<int64_t>(bytes / 16), lane);
    return;
  }
  for (uint64_t i = lane; i < bytes / 4; i += 32) {
    reinterpret_cast<uint32_t*>(dst)[i] = __ldcg(reinterpret_cast<const unsigned int*>(src) + i);
  }
}

// ---- LSA emulation --------------------------------------------------------------------------
class LsaTransport {
 public:
  __device__ LsaTransport(const dek_tp_lsa_t& d, int context)
      : d_(d), context_(context % (d.num_contexts > 0 ? d.num_contexts : 1)) {}

  __device__ int context() const { return context_; }

  // A plain pointer into the caller's own window (staging sources, reading received data).
  __device__ char* local(uint64_t off) const { return base(d_.rank) + off; }

  __device__ void put(int peer, uint64_t dst_off, uint64_t src_off, uint64_t bytes, int signal, uint64_t signal_add,
                      int lane) const {
    put_copy(base(peer) + dst_off, base(d_.rank) + src_off, bytes, lane);
    if (signal_add == 0) return;
    __syncwarp();  // every lane's stores happen-before lane 0's fence below
    if (lane == 0) raise(peer, signal, signal_add);
    __syncwarp();
  }

  // One thread: add to a peer's signal without payload (ordered after this thread's own stores).
  __device__ void signal(int peer, int signal, uint64_t add) const { raise(peer, signal, add); }

  __device__ uint64_t read_signal(int signal) const { return ld_acquire_sys(word(d_.rank, signal)); }

  __device__ bool wait_signal(int signal, uint64_t least, const Deadline& dl, uint64_t* seen) const {
    return poll_signal([&] { return read_signal(signal); }, least, dl, seen);
  }

  __device__ void reset_signal(int signal) const {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(word(d_.rank, signal)), "l"(uint64_t{0}) : "memory");
  }

  // Stores are complete when issued; the source is reusable at once.
  __device__ void flush(int /*lane*/) const { __syncwarp(); }

 private:
  __device__ char* base(int rank) const { return static_cast<char*>(d_.peer_base[rank]); }
  __device__ uint64_t* word(int rank, int signal) const {
    return reinterpret_cast<uint64_t*>(base(rank) + d_.signal_off +
                                       (static_cast<uint64_t>(context_) * d_.num_signals + signal) * 8);
  }
  __device__ void raise(int peer, int signal, uint64_t add) const {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(word(peer, signal)), "l"(add) : "memory");
  }

  const dek_tp_lsa_t& d_;
  int context_;
};

// ---- NCCL GIN -------------------------------------------------------------------------------
class GinTransport {
 public:
  // `comm` must outlive the transport (a __grid_constant__ kernel parameter or global memory).
  __device__ GinTransport(const ncclDevComm& comm, ncclWindow_t window, int context)
      : comm_(comm), win_(window), gin_(comm, context) {}

  __device__ int context() const { return gin_.contextId; }

  __device__ char* local(uint64_t off) const { return static_cast<char*>(ncclGetLocalPointer(win_, off)); }

  __device__ void put(int peer, uint64_t dst_off, uint64_t src_off, uint64_t bytes, int signal, uint64_t signal_add,
                      int /*lane*/) const {
    if (signal_add == 0) {
      gin_.put(ncclTeamWorld(comm_), peer, win_, dst_off, win_, src_off, bytes, ncclGin_None{}, ncclGin_None{},
               ncclCoopWarp());
    } else {
      gin_.put(ncclTeamWorld(comm_), peer, win_, dst_off, win_, src_off, bytes,
               ncclGin_SignalAdd{static_cast<ncclGinSignal_t>(signal), signal_add}, ncclGin_None{}, ncclCoopWarp());
    }
  }

  __device__ void signal(int peer, int signal, uint64_t add) const {
    gin_.signal(ncclTeamWorld(comm_), peer, ncclGin_SignalAdd{static_cast<ncclGinSignal_t>(signal), add});
  }

  __device__ uint64_t read_signal(int signal) const { return gin_.readSignal(static_cast<ncclGinSignal_t>(signal)); }

  // ncclGin::waitSignal has no deadline; poll readSignal instead.
  __device__ bool wait_signal(int signal, uint64_t least, const Deadline& dl, uint64_t* seen) const {
    return poll_signal([&] { return read_signal(signal); }, least, dl, seen);
  }

  __device__ void reset_signal(int signal) const { gin_.resetSignal(static_cast<ncclGinSignal_t>(signal)); }

  __device__ void flush(int /*lane*/) const { gin_.flush(ncclCoopWarp()); }

 private:
  const ncclDevComm& comm_;
  ncclWindow_t win_;
  ncclGin gin_;
};

// The (communicator, context) that routing unit `unit` (a sender: rank, channel, local expert) uses
// among `comms` communicators of `contexts` contexts each: g = unit mod (comms x contexts), comm =
// g / contexts, context = g mod contexts; consecutive units fill one communicator's contexts first.
// Host and device (crate::backend::nccl::gin::route, checked against this through
// dek_ll_gin_route).
__host__ __device__ __forceinline__ void gin_route(int unit, int comms, int contexts, int* comm, int* context) {
  const unsigned g = static_cast<unsigned>(unit) % static_cast<unsigned>(comms * contexts);
  *comm = static_cast<int>(g / static_cast<unsigned>(contexts));
  *context = static_cast<int>(g % static_cast<unsigned>(contexts));
}

}  // namespace

// ---- seam descriptors: what a kernel finds at a `net` pointer (device memory, written by the host
// at buffer creation) and turns into a transport of a given context -------------------------------
// Outside the anonymous namespace: kernels are templates over them, and a kernel instantiated with a
// type of internal linkage gets internal linkage itself (profilers then show `__nv_static_...`
// names, docs/OPS.md "Kernel names").
struct LsaNet {
  dek_tp_lsa_t d;
  __device__ LsaTransport at(int context) const { return LsaTransport(d, context); }
  __device__ int contexts() const { return d.num_contexts; }
  // Distinct signal tables: at(u) for u < units() visits each once (one communicator).
  __device__ int units() const { return d.num_contexts; }
};
// The NVLink-only LL kernels (one launch, one rank): their launchers refuse a seam (Args::net null),
// so every seam test folds to false at compile time and none of the seam code is in them. Their code
// is what an SM fetches again after any other kernel ran (an expert GEMM in a model's step):
// bench/NOTES.md, session 33.
struct NvlNet : LsaNet {};
// One GIN communicator of a buffer: its device comm (by value) and the buffer's window registered
// on it (every communicator registers the same memory).
struct GinComm {
  ncclDevComm comm;
  ncclWindow_t win;
};
// The buffer's GIN communicators (DEEP_EP_GIN_COMMS, 1..8). `num_contexts` is the fewest contexts
// any of them was granted (NCCL may grant fewer than asked), so every (comm, context) pair a unit
// routes to exists; QPs per peer = num_comms x num_contexts = units().
struct GinNet {
  GinComm c[DEK_TP_MAX_GIN_COMMS];
  int32_t num_comms;
  int32_t num_contexts;
  // The transport of routing unit `unit` (gin_route). A receiver waits with the unit of the sender
  // so it reads the signal table of the (comm, context) the sender raised.
  __device__ GinTransport at(int unit) const {
    int k, ctx;
    gin_route(unit, num_comms, num_contexts, &k, &ctx);
    return GinTransport(c[k].comm, c[k].win, ctx);
  }
  // Contexts per communicator.
  __device__ int contexts() const { return num_contexts; }
  // Distinct (comm, context) pairs: at(u) for u < units() visits each once (e.g. to reset signals).
  __device__ int units() const { return num_comms * num_contexts; }
};

}  // namespace tp
}  // namespace deep_ep
