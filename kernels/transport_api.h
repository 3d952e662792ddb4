/*
 * transport_api.h: the plain C side of the remote-peer transport (kernels/transport.cuh): the
 * descriptors a kernel gets, the host-mapped status it reports into, the GIN device-comm setup
 * and the transport self-test ("ping"). Same rules as deep_ep_kernels.h: device pointers unless
 * "host", `stream` is a cudaStream_t as void*, cudaError_t as int (0 = success), nothing throws.
 * Rust declarations are generated from this file by build.rs (bindgen: src/sys/kernels.rs); the
 * struct sizes are still compared at run time through dek_tp_struct_size (a stale build).
 */
#ifndef DEEP_EP_TRANSPORT_API_H
#define DEEP_EP_TRANSPORT_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Ranks the LSA emulation can address: every rank of a buffer on one machine whose GPUs (or, with
 * several ranks per GPU, whose ranks) all share load/store access, such as 2 x 8 or 4 x 4 ranks
 * emulated on one GPU (docs/RANKS.md). */
#define DEK_TP_MAX_LSA_PEERS 32
/* GIN contexts per communicator in NCCL 2.28 (NCCL_GIN_MAX_CONTEXTS). */
#define DEK_TP_MAX_GIN_CONTEXTS 4
/* NCCL communicators one buffer opens for more QPs per peer (crate::backend::nccl::gin::MAX_GIN_COMMS). */
#define DEK_TP_MAX_GIN_COMMS 8

/* Error codes a transport wait writes into dek_tp_status_t.error. */
#define DEK_TP_OK 0
#define DEK_TP_ERR_TIMEOUT 1      /* a signal did not reach its target before the deadline */
#define DEK_TP_ERR_DATA 2         /* self-test: received bytes differ from the sender's pattern */

/*
 * Host-mapped (cudaHostAllocMapped) error record. The first error of a launch wins: fields are
 * written first, `error` last (after a system fence), so a host that sees error != 0 sees the
 * fields of that error. The host zeroes it before reuse.
 */
typedef struct {
  int32_t error;       /* DEEP_EP_TP_ERR_* */
  int32_t peer;        /* world rank that was waited for (timeout) or sent bad data */
  int32_t signal;      /* signal id of the wait */
  int32_t context;     /* transport context (GIN context / emulated QP group) */
  uint64_t seen;       /* last signal value seen (timeout) or first bad word (data) */
  uint64_t expected;   /* value waited for, or the expected word */
} dek_tp_status_t;

/*
 * LSA emulation of the RDMA leg: every rank of the emulated world is a peer on one NVLink domain,
 * addressed through its window base. Signals are uint64 words in each rank's own window at
 * signal_off + (context * num_signals + signal) * 8, so per-context signal tables behave as GIN's.
 */
typedef struct {
  void* peer_base[DEK_TP_MAX_LSA_PEERS]; /* window base of every rank (own included) */
  int32_t rank;
  int32_t num_ranks;          /* <= DEK_TP_MAX_LSA_PEERS */
  int32_t num_contexts;       /* 1..DEK_TP_MAX_GIN_CONTEXTS, as GIN would give */
  int32_t num_signals;        /* signals per context */
  uint64_t signal_off;        /* byte offset of the signal table in every window (8-aligned) */
  uint64_t window_bytes;      /* bytes of every window */
} dek_tp_lsa_t;

/*
 * NVSHMEM transport (kernels/nvshmem/transport.cu, built with the NVSHMEM device library only when
 * the crate is built with feature `nvshmem` and NVSHMEM's headers are found): every rank is an
 * NVSHMEM PE (PE = world rank); the window is one nvshmem_malloc allocation, so `base` is the same
 * symmetric address on every PE and offsets translate directly. Signals are uint64 words of the
 * window (hence symmetric) at signal_off + (context * num_signals + signal) * 8, as the LSA
 * emulation's; NVSHMEM raises them with NVSHMEM_SIGNAL_ADD.
 */
typedef struct {
  void* base;                 /* symmetric address of the window (own PE's copy) */
  int32_t rank;               /* nvshmem_my_pe() */
  int32_t num_ranks;          /* nvshmem_n_pes() */
  int32_t num_contexts;       /* 1..DEK_TP_MAX_GIN_CONTEXTS: signal tables, as GIN's contexts */
  int32_t num_signals;        /* signals per context */
  uint64_t signal_off;        /* byte offset of the signal table in the window (8-aligned) */
  uint64_t window_bytes;      /* bytes of the window */
} dek_tp_nvshmem_t;

/* What ncclDevCommCreate is asked for (crate::backend::nccl::gin::GinRequirements). */
typedef struct {
  int32_t gin_context_count;  /* a hint: NCCL may give fewer (reported in dek_tp_gin_info_t) */
  int32_t gin_signal_count;
  int32_t gin_counter_count;
  int32_t lsa_barrier_count;
  int32_t gin_force_enable;   /* 1: fail instead of silently creating a comm without GIN */
} dek_tp_gin_reqs_t;

/* What the created device comm offers (read back from ncclDevComm). */
typedef struct {
  int32_t rank, num_ranks;
  int32_t lsa_rank, lsa_size;
  int32_t gin_context_count;  /* 0: no GIN (no GIN-capable NIC, or GIN disabled) */
  int32_t gin_type;           /* ncclNetDeviceType of context 0: 2 = proxy, 3 = GDAKI, else 0 */
  int32_t gin_signal_count;
  int32_t gin_counter_count;
} dek_tp_gin_info_t;

/*
 * Transport self-test: every rank of the rail team (ranks r with r % rail_stride == rank %
 * rail_stride, the ranks one RDMA hop away in DeepEP's topology) writes `bytes` of a pattern
 * derived from (rank, seq) to every other team member's window at dst_off + sender_team_index *
 * bytes, raising the receiver's signal `signal + sender_team_index` by 1; then it waits until each
 * of those signals reached `expect` (the caller's running count of rounds, so no reset is needed;
 * a timeout names the silent sender), checks every received block, and flushes. The team size is
 * num_ranks / rail_stride (rail_stride must divide num_ranks); signal ids used: signal ..
 * signal + team size - 1. One block of one warp per launch.
 */
typedef struct {
  int32_t rank, num_ranks;
  int32_t rail_stride;        /* 1: everyone; the NVLink domain size: one peer per node */
  int32_t context;            /* transport context used for puts and the wait */
  int32_t signal;             /* signal id raised on receivers and waited on */
  uint32_t seq;               /* varies the pattern between calls */
  uint64_t bytes;             /* per sender, multiple of 16 */
  uint64_t src_off;           /* staging area in the own window (>= bytes) */
  uint64_t dst_off;           /* receive area in every window (>= team size * bytes) */
  uint64_t expect;            /* signal value that means "all of this round arrived" */
  uint64_t timeout_ns;
  dek_tp_status_t* status; /* host-mapped */
  int32_t* claim;             /* device word zeroed by the host: decides the first error */
} dek_tp_ping_t;

/* Self-test over the LSA emulation. */
int dek_tp_ping_lsa(const dek_tp_lsa_t* lsa, const dek_tp_ping_t* args, void* stream);

/*
 * Self-test over NCCL GIN: `devcomm` is a host copy of an ncclDevComm made by
 * dek_tp_gin_devcomm_create, `window` the ncclWindow_t holding src and dst areas.
 */
int dek_tp_ping_gin(const void* devcomm, size_t devcomm_bytes, void* window, const dek_tp_ping_t* args,
                        void* stream);

/*
 * Self-test over NVSHMEM (only in builds with the NVSHMEM device library, see
 * deep_ep_tp_nvshmem_built): the module's device state must have been registered with
 * dek_tp_nvshmem_device_init after NVSHMEM's initialisation.
 */
int dek_tp_ping_nvshmem(const dek_tp_nvshmem_t* net, const dek_tp_ping_t* args, void* stream);
/*
 * Registers this library's NVSHMEM device state (the nvshmemi_device_state_d the device library
 * linked into it reads) with the NVSHMEM host library that the caller initialised: calls
 * `cumodule_init` (nvshmemx_cumodule_init resolved from libnvshmem_host, as int (*)(CUmodule)) on
 * the CUDA module of the NVSHMEM kernels in the current context. Returns 0, the NVSHMEM status,
 * or a cudaError_t + 1000 when the module could not be found.
 */
int dek_tp_nvshmem_device_init(void* cumodule_init);
/* The inverse (nvshmemx_cumodule_finalize), before NVSHMEM is finalised. Same returns. */
int dek_tp_nvshmem_device_fini(void* cumodule_finalize);
/*
 * ncclDevCommCreate with GIN requirements. `create_fn` is ncclDevCommCreate resolved from the
 * loaded NCCL (nothing here links libnccl); `devcomm` receives the struct (devcomm_bytes >=
 * dek_nccl_devcomm_bytes()). Returns the ncclResult_t as int (-1: bad arguments); on success
 * `info` describes what NCCL granted.
 */
int dek_tp_gin_devcomm_create(void* create_fn, void* comm, const dek_tp_gin_reqs_t* reqs, void* devcomm,
                                  size_t devcomm_bytes, dek_tp_gin_info_t* info);

/* Writes `info` into a zeroed ncclDevComm (the fields dek_tp_gin_devcomm_create reads back):
 * for stand-ins of ncclDevCommCreate in tests without a NIC. -1 on bad arguments. */
int dek_tp_devcomm_fill(void* devcomm, size_t devcomm_bytes, const dek_tp_gin_info_t* info);

/* sizeof of the structs above by index (0 status, 1 lsa, 2 gin_reqs, 3 gin_info, 4 ping, 5 nvshmem); 0 if unknown. */
size_t dek_tp_struct_size(int which);

#ifdef __cplusplus
}
#endif

#endif /* DEEP_EP_TRANSPORT_API_H */
