/*
 * deep_ep_kernels.h: the plain C launch API of the CUDA sources in kernels/ (the torch-free seam).
 *
 * Rules for every function here:
 *   - pointers are device pointers unless the comment says "host";
 *   - `stream` is a cudaStream_t passed as void* (NULL = legacy default stream); launches are
 *     asynchronous on it and nothing synchronises the host;
 *   - the return value is a cudaError_t as int (0 = cudaSuccess). Launch functions check their
 *     arguments first (cudaErrorInvalidValue) and cudaGetLastError() after the launch;
 *   - no function throws, aborts or prints.
 * Rust declarations: src/ffi/kernels.rs (keep both in step).
 */
#ifndef DEEP_EP_KERNELS_H
#define DEEP_EP_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * DeepEP's get_dispatch_layout. N = num_tokens, K = num_topk, R = num_ranks, E = num_experts,
 * G = R / 8 nodes when R > 8 (else 0). Expert e lives on rank e / (E / R).
 *
 * [IN]  topk_idx                 [N, K] row-major, int64 if topk_idx_is_int64 else int32;
 *                                global expert ids, entries outside [0, E) (e.g. -1) are ignored
 * [OUT] num_tokens_per_rank      [R] int32: tokens with >= 1 selected expert on rank r
 * [OUT] num_tokens_per_rdma_rank [G] int32: tokens with >= 1 selected expert on node g;
 *                                required when R > 8, ignored (may be NULL) when R <= 8
 * [OUT] num_tokens_per_expert    [E] int32: (token, k) selections of expert e
 * [OUT] is_token_in_rank         [N, R] bool (1 byte): token n selects >= 1 expert on rank r
 *
 * Requires R > 0, E % R == 0, and R % 8 == 0 when R > 8. N == 0 is allowed (counts become 0).
 * Results are integer counts, identical for any launch configuration (crate::layout).
 * One kernel launch, preceded by a small zeroing kernel when N needs more than one block
 * (e.g. N > 128 at K = 8). CUDA-graph capturable; about 4 us of GPU time at N = 4096, K = 8.
 */
int deep_ep_launch_dispatch_layout(const void* topk_idx, int topk_idx_is_int64, int num_tokens,
                                   int num_topk, int num_ranks, int num_experts,
                                   int* num_tokens_per_rank, int* num_tokens_per_rdma_rank,
                                   int* num_tokens_per_expert, bool* is_token_in_rank,
                                   void* stream);

/* Static name of a cudaError_t ("cudaErrorInvalidValue"); never NULL. Needs no device. */
const char* deep_ep_cuda_error_name(int status);

/* Static description of a cudaError_t ("invalid argument"); never NULL. Needs no device. */
const char* deep_ep_cuda_error_string(int status);

/* [OUT host] count: number of visible CUDA devices (cudaGetDeviceCount). */
int deep_ep_cuda_device_count(int* count);

/* Small runtime helpers (tests and host-side plumbing). Synchronous unless named _async. */
int deep_ep_cuda_set_device(int device);
int deep_ep_cuda_malloc(void** ptr, size_t bytes);
int deep_ep_cuda_free(void* ptr);
int deep_ep_cuda_memcpy_htod(void* dst, const void* host_src, size_t bytes);
int deep_ep_cuda_memcpy_dtoh(void* host_dst, const void* src, size_t bytes);
int deep_ep_cuda_memset_async(void* ptr, int value, size_t bytes, void* stream);
int deep_ep_cuda_stream_synchronize(void* stream);

#ifdef __cplusplus
}
#endif

#endif /* DEEP_EP_KERNELS_H */
