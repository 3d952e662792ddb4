// runtime.cu: tiny CUDA runtime helpers behind the C API (error names, device count, and the
// allocation/copy calls the Rust tests use). Host code only.
#include "common.cuh"

extern "C" const char* deep_ep_cuda_error_name(int status) {
  return cudaGetErrorName(static_cast<cudaError_t>(status));
}

extern "C" const char* deep_ep_cuda_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

extern "C" int deep_ep_cuda_device_count(int* count) {
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = 0;
  return cudaGetDeviceCount(count);
}

extern "C" int deep_ep_cuda_set_device(int device) { return cudaSetDevice(device); }

extern "C" int deep_ep_cuda_malloc(void** ptr, size_t bytes) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  return cudaMalloc(ptr, bytes);
}

extern "C" int deep_ep_cuda_free(void* ptr) { return cudaFree(ptr); }

extern "C" int deep_ep_cuda_memcpy_htod(void* dst, const void* host_src, size_t bytes) {
  return cudaMemcpy(dst, host_src, bytes, cudaMemcpyHostToDevice);
}

extern "C" int deep_ep_cuda_memcpy_dtoh(void* host_dst, const void* src, size_t bytes) {
  return cudaMemcpy(host_dst, src, bytes, cudaMemcpyDeviceToHost);
}

extern "C" int deep_ep_cuda_memset_async(void* ptr, int value, size_t bytes, void* stream) {
  return cudaMemsetAsync(ptr, value, bytes, deep_ep::as_stream(stream));
}

extern "C" int deep_ep_cuda_stream_synchronize(void* stream) {
  return cudaStreamSynchronize(deep_ep::as_stream(stream));
}
