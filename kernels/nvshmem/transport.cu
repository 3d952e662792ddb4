// nvshmem/transport.cu: the remote-peer transport seam (kernels/transport.cuh) on NVSHMEM's device
// API, and its self-test. This is the only translation unit compiled with relocatable device code:
// build.rs compiles it with -rdc=true, device-links it against NVSHMEM's libnvshmem_device.a and
// archives both objects (only with feature `nvshmem` and NVSHMEM headers found), so every other
// kernel keeps its whole-program compilation.
//
// Initialisation: NVSHMEM's host library is dlopen'ed by src/ffi/nvshmem.rs and initialised
// host-only (nvshmemx_hostlib_init_attr). The device library linked here carries its own
// nvshmemi_device_state_d (in this library's CUDA module); dek_tp_nvshmem_device_init hands
// that module to the host library's nvshmemx_cumodule_init, which fills the state (heap bases,
// peer table, IBGDA/proxy state) and keeps it up to date. Until then every device call would read a
// zeroed state, so the Rust side registers right after NVSHMEM's initialisation.
//
// NvshmemTransport keeps the seam's contract:
//   - put: nvshmemx_putmem_signal_nbi_warp (NVSHMEM_SIGNAL_ADD) or nvshmemx_putmem_nbi_warp. The
//     signal covers the warp's earlier puts to that peer too: NVSHMEM orders a put-with-signal's
//     signal after its own payload only, so lane 0 issues nvshmem_fence() (orders puts to one PE)
//     first.
//   - signal: nvshmem_fence() then nvshmemx_signal_op(NVSHMEM_SIGNAL_ADD).
//   - contexts: NVSHMEM has no per-context signal tables on the device; they are laid out in the
//     symmetric window (signal_off + (context * num_signals + signal) * 8), as the LSA emulation's.
//   - wait_signal: nvshmem_signal_fetch (a volatile load) polled against a globaltimer deadline,
//     then an acquire fence (the fetch itself has no acquire semantics).
//   - flush: nvshmem_quiet() (all of this PE's puts complete, sources reusable).
#include <cuda.h>

#include <cstdio>

#include "../transport_ping.cuh"

// NVSHMEM's device headers trip -Wunused-parameter in the host pass, as NCCL's do.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <nvshmem.h>
#include <nvshmemx.h>
#pragma GCC diagnostic pop

namespace deep_ep {
namespace tp {
namespace {

class NvshmemTransport {
 public:
  __device__ NvshmemTransport(const dek_tp_nvshmem_t& d, int context)
      : d_(d), context_(context % (d.num_contexts > 0 ? d.num_contexts : 1)) {}

  __device__ int context() const { return context_; }

  __device__ char* local(uint64_t off) const { return static_cast<char*>(d_.base) + off; }

  __device__ void put(int peer, uint64_t dst_off, uint64_t src_off, uint64_t bytes, int signal, uint64_t signal_add,
                      int lane) const {
    if (signal_add == 0) {
      nvshmemx_putmem_nbi_warp(local(dst_off), local(src_off), bytes, peer);
      return;
    }
    __syncwarp();
    if (lane == 0) nvshmem_fence();  // earlier puts of this warp to `peer` before this put's signal
    __syncwarp();
    nvshmemx_putmem_signal_nbi_warp(local(dst_off), local(src_off), bytes, word(signal), signal_add,
                                    NVSHMEM_SIGNAL_ADD, peer);
  }

  // One thread: add to a peer's signal without payload, after this PE's earlier puts to it.
  __device__ void signal(int peer, int signal, uint64_t add) const {
    nvshmem_fence();
    nvshmemx_signal_op(word(signal), add, NVSHMEM_SIGNAL_ADD, peer);
  }

  __device__ uint64_t read_signal(int signal) const {
    const uint64_t v = nvshmem_signal_fetch(word(signal));
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    return v;
  }

  // Polls without a fence per read (read_signal fences each one); one fence once reached.
  __device__ bool wait_signal(int signal, uint64_t least, const Deadline& dl, uint64_t* seen) const {
    if (!poll_signal([&] { return nvshmem_signal_fetch(word(signal)); }, least, dl, seen)) return false;
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    return true;
  }

  __device__ void reset_signal(int signal) const {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(word(signal)), "l"(uint64_t{0}) : "memory");
  }

  __device__ void flush(int lane) const {
    __syncwarp();
    if (lane == 0) nvshmem_quiet();
    __syncwarp();
  }

 private:
  // The symmetric address of signal `signal` of this context (own PE's copy; NVSHMEM translates it
  // for the peer).
  __device__ uint64_t* word(int signal) const {
    return reinterpret_cast<uint64_t*>(local(d_.signal_off + (static_cast<uint64_t>(context_) * d_.num_signals + signal) * 8));
  }

  const dek_tp_nvshmem_t& d_;
  int context_;
};

// The seam descriptor (as LsaNet): what a kernel finds at a `net` pointer.
struct NvshmemNet {
  dek_tp_nvshmem_t d;
  __device__ NvshmemTransport at(int context) const { return NvshmemTransport(d, context); }
  __device__ int contexts() const { return d.num_contexts; }
  __device__ int units() const { return d.num_contexts; }
};

}  // namespace

__global__ void ping_nvshmem(const __grid_constant__ dek_tp_nvshmem_t d, const dek_tp_ping_t a) {
  const NvshmemTransport t(d, a.context);
  ping(t, a);
}

namespace {

using CuFuncGetModuleFn = CUresult (*)(CUmodule*, CUfunction);
using CuModuleFn = int (*)(CUmodule);

// The CUDA module (current context) holding this unit's kernels and NVSHMEM's device state.
int own_module(CUmodule* out) {
  cudaFunction_t f = nullptr;
  cudaError_t e = cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(ping_nvshmem));
  if (e != cudaSuccess) return 1000 + static_cast<int>(e);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  e = cudaGetDriverEntryPointByVersion("cuFuncGetModule", &fn, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || fn == nullptr || q != cudaDriverEntryPointSuccess)
    return 1000 + static_cast<int>(e != cudaSuccess ? e : cudaErrorSymbolNotFound);
  const CUresult r = reinterpret_cast<CuFuncGetModuleFn>(fn)(out, reinterpret_cast<CUfunction>(f));
  return r == CUDA_SUCCESS ? 0 : 1000 + static_cast<int>(cudaErrorInvalidResourceHandle);
}

}  // namespace
}  // namespace tp
}  // namespace deep_ep

// The host half of libnvshmem_device.a (linked in because the device-link stub names its fatbin
// wrappers) calls three entry points of NVSHMEM's host library from its own initialiser
// (nvshmemi_init_thread, i.e. nvshmem_init), its finaliser and nvshmemx_collective_launch. This
// library uses none of those: NVSHMEM is initialised through the dlopen'ed host library and the
// module registered with nvshmemx_cumodule_init. So they are defined here, hidden (the library's
// link resolves them internally and exports nothing), reporting "not initialised" and refusing,
// instead of leaving undefined symbols that would stop the library from loading.
extern "C" __attribute__((visibility("hidden"))) int nvshmemid_init_status() { return 0; }
extern "C" __attribute__((visibility("hidden"))) int nvshmemid_hostlib_init_attr(int, int*, unsigned int, nvshmemx_init_attr_t*,
                                                                                nvshmemi_version_t,
                                                                                nvshmemx_device_lib_init_cb) {
  fprintf(stderr, "deep_ep: NVSHMEM's device-library initialiser is not supported in this library; "
                  "NVSHMEM is initialised by the nvshmem backend\n");
  return 7;  // NVSHMEMX_ERROR_INTERNAL
}
extern "C" __attribute__((visibility("hidden"))) void nvshmemid_hostlib_finalize(void*, void*) {}

extern "C" int dek_tp_nvshmem_device_init(void* cumodule_init) {
  if (cumodule_init == nullptr) return 1000 + static_cast<int>(cudaErrorInvalidValue);
  CUmodule m = nullptr;
  const int e = deep_ep::tp::own_module(&m);
  return e != 0 ? e : reinterpret_cast<deep_ep::tp::CuModuleFn>(cumodule_init)(m);
}

extern "C" int dek_tp_nvshmem_device_fini(void* cumodule_finalize) {
  if (cumodule_finalize == nullptr) return 1000 + static_cast<int>(cudaErrorInvalidValue);
  CUmodule m = nullptr;
  const int e = deep_ep::tp::own_module(&m);
  return e != 0 ? e : reinterpret_cast<deep_ep::tp::CuModuleFn>(cumodule_finalize)(m);
}

extern "C" int dek_tp_ping_nvshmem(const dek_tp_nvshmem_t* net, const dek_tp_ping_t* args, void* stream) {
  using namespace deep_ep::tp;
  if (net == nullptr || net->base == nullptr || !ping_args_ok(args) || net->num_ranks != args->num_ranks ||
      net->rank != args->rank || net->num_contexts < 1 || net->num_contexts > DEK_TP_MAX_GIN_CONTEXTS ||
      net->signal_off % 8 != 0 || args->signal + args->num_ranks / args->rail_stride > net->num_signals ||
      net->signal_off + 8ull * net->num_contexts * net->num_signals > net->window_bytes ||
      args->src_off + args->bytes > net->window_bytes ||
      args->dst_off + args->bytes * (args->num_ranks / args->rail_stride) > net->window_bytes)
    return cudaErrorInvalidValue;
  ping_nvshmem<<<1, 32, 0, deep_ep::as_stream(stream)>>>(*net, *args);
  return static_cast<int>(cudaGetLastError());
}
