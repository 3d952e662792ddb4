// runtime.cu: tiny CUDA runtime helpers behind the C API (error names, device count, and the
// allocation/copy calls the Rust tests use). Host code only.
#include <cstring>

#include "common.cuh"

extern "C" const char* dek_cuda_error_name(int status) {
  return cudaGetErrorName(static_cast<cudaError_t>(status));
}

extern "C" const char* dek_cuda_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

extern "C" int dek_cuda_device_count(int* count) {
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = 0;
  return cudaGetDeviceCount(count);
}

extern "C" int dek_cuda_set_device(int device) { return cudaSetDevice(device); }

extern "C" int dek_cuda_malloc(void** ptr, size_t bytes) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  return cudaMalloc(ptr, bytes);
}

extern "C" int dek_cuda_free(void* ptr) { return cudaFree(ptr); }

extern "C" int dek_cuda_memcpy_htod(void* dst, const void* host_src, size_t bytes) {
  return cudaMemcpy(dst, host_src, bytes, cudaMemcpyHostToDevice);
}

extern "C" int dek_cuda_memcpy_dtoh(void* host_dst, const void* src, size_t bytes) {
  return cudaMemcpy(host_dst, src, bytes, cudaMemcpyDeviceToHost);
}

extern "C" int dek_cuda_memset_async(void* ptr, int value, size_t bytes, void* stream) {
  return cudaMemsetAsync(ptr, value, bytes, deep_ep::as_stream(stream));
}

extern "C" int dek_cuda_stream_synchronize(void* stream) {
  return cudaStreamSynchronize(deep_ep::as_stream(stream));
}

extern "C" int dek_cuda_get_device(int* device) {
  if (device == nullptr) return cudaErrorInvalidValue;
  return cudaGetDevice(device);
}

extern "C" int dek_cuda_sm_count(int device, int* sms) {
  if (sms == nullptr) return cudaErrorInvalidValue;
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

extern "C" int dek_cuda_versions(int* runtime, int* driver) {
  if (runtime == nullptr || driver == nullptr) return cudaErrorInvalidValue;
  *runtime = 0;
  *driver = 0;
  const cudaError_t st = cudaRuntimeGetVersion(runtime);
  if (cudaDriverGetVersion(driver) != cudaSuccess) *driver = 0;
  return st;
}

extern "C" int dek_cuda_host_alloc_mapped(void** host, void** device_ptr, size_t bytes) {
  if (host == nullptr || device_ptr == nullptr) return cudaErrorInvalidValue;
  *host = nullptr;
  *device_ptr = nullptr;
  DEEP_EP_TRY(cudaHostAlloc(host, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  const cudaError_t st = cudaHostGetDevicePointer(device_ptr, *host, 0);
  if (st != cudaSuccess) {
    cudaFreeHost(*host);
    *host = nullptr;
  }
  return st;
}

extern "C" int dek_cuda_free_host(void* host) { return cudaFreeHost(host); }

// CUDA IPC (the ipc window provider, src/ffi/ipc_window.rs). A handle is 64 opaque bytes.
static_assert(sizeof(cudaIpcMemHandle_t) == DEK_IPC_HANDLE_BYTES, "cudaIpcMemHandle_t size");

extern "C" int dek_cuda_ipc_get_handle(void* handle, void* ptr) {
  if (handle == nullptr) return cudaErrorInvalidValue;
  return cudaIpcGetMemHandle(static_cast<cudaIpcMemHandle_t*>(handle), ptr);
}

extern "C" int dek_cuda_ipc_open(void** ptr, const void* handle) {
  if (ptr == nullptr || handle == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}

extern "C" int dek_cuda_ipc_close(void* ptr) { return cudaIpcCloseMemHandle(ptr); }

extern "C" int dek_cuda_pci_id(int device, unsigned long long* id) {
  if (id == nullptr) return cudaErrorInvalidValue;
  int domain = 0, bus = 0, dev = 0;
  DEEP_EP_TRY(cudaDeviceGetAttribute(&domain, cudaDevAttrPciDomainId, device));
  DEEP_EP_TRY(cudaDeviceGetAttribute(&bus, cudaDevAttrPciBusId, device));
  DEEP_EP_TRY(cudaDeviceGetAttribute(&dev, cudaDevAttrPciDeviceId, device));
  *id = (static_cast<unsigned long long>(domain) << 32) | (static_cast<unsigned long long>(bus) << 8) | static_cast<unsigned long long>(dev);
  return cudaSuccess;
}

extern "C" int dek_cuda_stream_create(void** stream) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  cudaStream_t s = nullptr;
  DEEP_EP_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *stream = s;
  return cudaSuccess;
}

extern "C" int dek_cuda_stream_destroy(void* stream) { return cudaStreamDestroy(deep_ep::as_stream(stream)); }

extern "C" int dek_cuda_device_synchronize(void) { return cudaDeviceSynchronize(); }
