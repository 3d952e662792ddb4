// ll_rows.cu: the real token count of a low-latency call as a device scalar. A captured CUDA
// graph has static shapes; to let one graph serve any batch n <= N, the rows of topk_idx at or
// past n are rewritten to -1 ("not routed") into a copy on the caller's stream, and the LL
// kernels run on that copy. n is read on the device at every launch or replay.
#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace deep_ep {
namespace ll {
namespace {

constexpr int kRowsThreads = 256;
constexpr int64_t kRowsMaxBlocks = 1024;

}  // namespace

template <typename IdxT>
__global__ void __launch_bounds__(kRowsThreads) mask_num_tokens(const IdxT* __restrict__ in, IdxT* __restrict__ out, int64_t num_rows,
                                                                int num_topk, const int32_t* num_tokens) {
  // Clamped, not trapped: an out-of-range count cannot be reported without a host sync.
  int64_t n = *num_tokens;
  n = n < 0 ? 0 : (n > num_rows ? num_rows : n);
  const int64_t total = num_rows * num_topk, limit = n * num_topk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride)
    out[i] = i < limit ? in[i] : static_cast<IdxT>(-1);
}

}  // namespace ll
}  // namespace deep_ep

extern "C" int dek_ll_mask_rows(const void* topk_idx, int topk_idx_is_int64, int64_t num_rows, int num_topk,
                                           const int32_t* num_tokens, void* out, void* stream) {
  using namespace deep_ep::ll;
  if (topk_idx == nullptr || out == nullptr || num_tokens == nullptr || num_rows < 0 || num_topk <= 0) return cudaErrorInvalidValue;
  const int64_t total = num_rows * num_topk;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min((total + kRowsThreads - 1) / kRowsThreads, kRowsMaxBlocks);
  auto s = static_cast<cudaStream_t>(stream);
  if (topk_idx_is_int64) {
    mask_num_tokens<int64_t><<<static_cast<int>(blocks), kRowsThreads, 0, s>>>(static_cast<const int64_t*>(topk_idx),
                                                                                   static_cast<int64_t*>(out), num_rows, num_topk, num_tokens);
  } else {
    mask_num_tokens<int32_t><<<static_cast<int>(blocks), kRowsThreads, 0, s>>>(static_cast<const int32_t*>(topk_idx),
                                                                                   static_cast<int32_t*>(out), num_rows, num_topk, num_tokens);
  }
  return static_cast<int>(cudaGetLastError());
}
