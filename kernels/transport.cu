// transport.cu: host glue of the remote-peer transport (kernels/transport.cuh): GIN device-comm
// creation and the transport self-test ("ping"), instantiated for both the LSA emulation and NCCL
// GIN so that the GIN path is compiled (and type-checked against nccl_device/gin.h) in every build.
// C API: kernels/transport_api.h.
#include <cstring>

#include "common.cuh"
#include "transport.cuh"
#include "transport_ping.cuh"

namespace deep_ep {
namespace tp {
namespace {

using DevCommCreateFn = ncclResult_t (*)(ncclComm_t, const ncclDevCommRequirements_t*, ncclDevComm_t*);

}  // namespace

__global__ void ping_lsa(const __grid_constant__ dek_tp_lsa_t d, const dek_tp_ping_t a) {
  const LsaTransport t(d, a.context);
  ping(t, a);
}

__global__ void ping_gin(const __grid_constant__ ncclDevComm comm, ncclWindow_t win, const dek_tp_ping_t a) {
  const GinTransport t(comm, win, a.context);
  ping(t, a);
}
}  // namespace tp
}  // namespace deep_ep

extern "C" int dek_tp_ping_lsa(const dek_tp_lsa_t* lsa, const dek_tp_ping_t* args, void* stream) {
  using namespace deep_ep::tp;
  if (lsa == nullptr || !ping_args_ok(args) || lsa->num_ranks != args->num_ranks || lsa->rank != args->rank ||
      lsa->num_ranks > DEK_TP_MAX_LSA_PEERS || lsa->num_contexts < 1 ||
      lsa->num_contexts > DEK_TP_MAX_GIN_CONTEXTS || lsa->signal_off % 8 != 0 ||
      args->signal + args->num_ranks / args->rail_stride > lsa->num_signals ||
      lsa->signal_off + 8ull * lsa->num_contexts * lsa->num_signals > lsa->window_bytes ||
      args->src_off + args->bytes > lsa->window_bytes ||
      args->dst_off + args->bytes * (args->num_ranks / args->rail_stride) > lsa->window_bytes)
    return cudaErrorInvalidValue;
  for (int p = 0; p < lsa->num_ranks; ++p) {
    if (lsa->peer_base[p] == nullptr) return cudaErrorInvalidValue;
  }
  ping_lsa<<<1, 32, 0, deep_ep::as_stream(stream)>>>(*lsa, *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int dek_tp_ping_gin(const void* devcomm, size_t devcomm_bytes, void* window,
                                   const dek_tp_ping_t* args, void* stream) {
  using namespace deep_ep::tp;
  if (devcomm == nullptr || devcomm_bytes < sizeof(ncclDevComm) || window == nullptr || !ping_args_ok(args))
    return cudaErrorInvalidValue;
  ncclDevComm comm;
  std::memcpy(&comm, devcomm, sizeof(comm));
  if (comm.ginContextCount < 1 || comm.nRanks != args->num_ranks || comm.rank != args->rank ||
      args->signal + args->num_ranks / args->rail_stride > comm.ginSignalCount)
    return cudaErrorInvalidValue;
  ping_gin<<<1, 32, 0, deep_ep::as_stream(stream)>>>(comm, static_cast<ncclWindow_t>(window), *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int dek_tp_gin_devcomm_create(void* create_fn, void* comm, const dek_tp_gin_reqs_t* reqs,
                                             void* devcomm, size_t devcomm_bytes, dek_tp_gin_info_t* info) {
  if (create_fn == nullptr || comm == nullptr || reqs == nullptr || devcomm == nullptr ||
      devcomm_bytes < sizeof(ncclDevComm) || info == nullptr || reqs->gin_context_count < 0 ||
      reqs->gin_context_count > DEK_TP_MAX_GIN_CONTEXTS || reqs->gin_signal_count < 0 ||
      reqs->gin_counter_count < 0 || reqs->lsa_barrier_count < 0)
    return -1;
  ncclDevCommRequirements_t r;
  std::memset(&r, 0, sizeof(r));  // 2.28.9 has no initializer macro; lsaMultimem stays false
  r.lsaBarrierCount = reqs->lsa_barrier_count;
  r.ginForceEnable = reqs->gin_force_enable != 0;
  r.ginContextCount = reqs->gin_context_count;
  r.ginSignalCount = reqs->gin_signal_count;
  r.ginCounterCount = reqs->gin_counter_count;
  ncclDevComm* out = static_cast<ncclDevComm*>(devcomm);
  std::memset(out, 0, sizeof(ncclDevComm));
  const ncclResult_t res = reinterpret_cast<deep_ep::tp::DevCommCreateFn>(create_fn)(static_cast<ncclComm_t>(comm), &r, out);
  std::memset(info, 0, sizeof(*info));
  if (res == ncclSuccess) {
    info->rank = out->rank;
    info->num_ranks = out->nRanks;
    info->lsa_rank = out->lsaRank;
    info->lsa_size = out->lsaSize;
    info->gin_context_count = out->ginContextCount;
    info->gin_type = out->ginContextCount > 0 ? static_cast<int32_t>(out->ginTypes[0]) : 0;
    info->gin_signal_count = out->ginSignalCount;
    info->gin_counter_count = out->ginCounterCount;
  }
  return static_cast<int>(res);
}

extern "C" size_t dek_tp_struct_size(int which) {
  switch (which) {
    case 0: return sizeof(dek_tp_status_t);
    case 1: return sizeof(dek_tp_lsa_t);
    case 2: return sizeof(dek_tp_gin_reqs_t);
    case 3: return sizeof(dek_tp_gin_info_t);
    case 4: return sizeof(dek_tp_ping_t);
    case 5: return sizeof(dek_tp_nvshmem_t);
    default: return 0;
  }
}

// The inverse of what dek_tp_gin_devcomm_create reads back: writes `info`'s fields into a
// zeroed ncclDevComm at `devcomm`. Only for stand-ins of ncclDevCommCreate (unit tests without a
// NIC), so that they can grant GIN as NCCL would. Returns -1 on bad arguments.
extern "C" int dek_tp_devcomm_fill(void* devcomm, size_t devcomm_bytes, const dek_tp_gin_info_t* info) {
  if (devcomm == nullptr || devcomm_bytes < sizeof(ncclDevComm) || info == nullptr || info->gin_context_count < 0 ||
      info->gin_context_count > DEK_TP_MAX_GIN_CONTEXTS)
    return -1;
  ncclDevComm* out = static_cast<ncclDevComm*>(devcomm);
  std::memset(out, 0, sizeof(ncclDevComm));
  out->rank = info->rank;
  out->nRanks = info->num_ranks;
  out->lsaRank = info->lsa_rank;
  out->lsaSize = info->lsa_size;
  out->ginContextCount = static_cast<uint8_t>(info->gin_context_count);
  for (int c = 0; c < info->gin_context_count; ++c) out->ginTypes[c] = static_cast<uint8_t>(info->gin_type);
  out->ginSignalCount = info->gin_signal_count;
  out->ginCounterCount = info->gin_counter_count;
  return 0;
}
