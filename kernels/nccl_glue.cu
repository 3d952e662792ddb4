// nccl_glue.cu: the C++-only parts of NCCL's device API that Rust cannot call directly.
// ncclDevCommRequirements / ncclDevComm are C++ structs of nccl_device.h, and window peer
// pointers exist only on the device. NCCL itself is dlopen'ed by Rust (src/ffi/nccl.rs), which
// passes the function pointers in: nothing here links against libnccl.
#include <cstring>

// NCCL's device headers trip -Wunused-parameter in the host pass; they are not ours to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <nccl.h>
#include <nccl_device.h>
#pragma GCC diagnostic pop

#include "common.cuh"

namespace {

using DevCommCreateFn = ncclResult_t (*)(ncclComm_t, const ncclDevCommRequirements_t*, ncclDevComm_t*);
using DevCommDestroyFn = ncclResult_t (*)(ncclComm_t, const ncclDevComm_t*);

}  // namespace

namespace deep_ep {
namespace window {

// LSA pointers by LSA rank: ncclGetPeerPointer would take world ranks but is only defined inside
// the LSA team (it assumes the team is the world ranks around this one), which on a cluster is
// the node, not the buffer.
__global__ void nccl_lsa_bases(ncclWindow_t window, int lsa_size, void** out) {
  const int i = threadIdx.x;
  if (i < lsa_size) out[i] = ncclGetLsaPointer(window, 0, i);
}

}  // namespace window
}  // namespace deep_ep

extern "C" size_t dek_nccl_devcomm_bytes(void) { return sizeof(ncclDevComm); }

extern "C" int dek_nccl_devcomm_create(void* create_fn, void* comm, int lsa_barrier_count, void* devcomm,
                                           size_t devcomm_bytes, int* lsa_size, int* lsa_rank) {
  if (create_fn == nullptr || comm == nullptr || devcomm == nullptr || devcomm_bytes < sizeof(ncclDevComm) ||
      lsa_size == nullptr || lsa_rank == nullptr)
    return -1;
  ncclDevCommRequirements_t reqs;
  std::memset(&reqs, 0, sizeof(reqs));  // 2.28.9 has no initializer macro; lsaMultimem stays false
  reqs.lsaBarrierCount = lsa_barrier_count;
  ncclDevComm* out = static_cast<ncclDevComm*>(devcomm);
  std::memset(out, 0, sizeof(ncclDevComm));
  const ncclResult_t res = reinterpret_cast<DevCommCreateFn>(create_fn)(static_cast<ncclComm_t>(comm), &reqs, out);
  if (res == ncclSuccess) {
    *lsa_size = out->lsaSize;
    *lsa_rank = out->lsaRank;
  }
  return static_cast<int>(res);
}

extern "C" int dek_nccl_devcomm_destroy(void* destroy_fn, void* comm, const void* devcomm) {
  if (destroy_fn == nullptr || comm == nullptr || devcomm == nullptr) return -1;
  return static_cast<int>(reinterpret_cast<DevCommDestroyFn>(destroy_fn)(static_cast<ncclComm_t>(comm),
                                                                        static_cast<const ncclDevComm*>(devcomm)));
}

extern "C" int dek_nccl_window_lsa_bases(void* window, int lsa_size, void** base) {
  if (window == nullptr || base == nullptr || lsa_size < 1 || lsa_size > 1024) return cudaErrorInvalidValue;
  void** dev = nullptr;
  DEEP_EP_TRY(cudaMalloc(&dev, sizeof(void*) * lsa_size));
  deep_ep::window::nccl_lsa_bases<<<1, lsa_size>>>(static_cast<ncclWindow_t>(window), lsa_size, dev);
  cudaError_t st = cudaGetLastError();
  if (st == cudaSuccess) st = cudaMemcpy(base, dev, sizeof(void*) * lsa_size, cudaMemcpyDeviceToHost);
  const cudaError_t freed = cudaFree(dev);
  return static_cast<int>(st != cudaSuccess ? st : freed);
}
