// Buffer lifecycle, the local buffer view, size hints, rank masking and wait statistics. These take no device tensors, so
// they are registered for CompositeExplicitAutograd (any device, no autograd).
#include "common.h"

namespace deep_ep_ops {
namespace {

Tensor get_unique_id(std::string_view backend, std::optional<Device> device) {
  current_op() = "deep_ep::get_unique_id";
  auto id = empty_on({DEEP_EP_UNIQUE_ID_BYTES}, ScalarType::Byte, Device(DeviceType::CPU));
  const bool cuda = device.has_value() && device->type() == DeviceType::CUDA;
  int32_t dev = cuda ? device->index() : -1;
  if (cuda && dev < 0) dev = 0;
  std::string b(backend);
  check(deep_ep_get_unique_id(b.c_str(), dev, static_cast<uint8_t*>(id.data_ptr())));
  return id;
}

int64_t create_buffer(const Tensor& unique_id, int64_t rank, int64_t num_ranks, Device device, int64_t num_nvl_bytes,
                      int64_t num_rdma_bytes, bool low_latency_mode, std::string_view backend) {
  DEEP_EP_CHECK(unique_id.is_cpu() && unique_id.scalar_type() == ScalarType::Byte && unique_id.dim() == 1,
                "deep_ep::create_buffer: unique_id must be a 1-D uint8 CPU tensor from get_unique_id, got ",
                dtype_name(unique_id.scalar_type()), " of shape ", shape_of(unique_id), " on ",
                to_string(unique_id.device()));
  DEEP_EP_CHECK(device.type() == DeviceType::CPU || device.type() == DeviceType::CUDA,
                "deep_ep::create_buffer: device must be cpu or cuda, got ", to_string(device));
  auto id = torch::stable::contiguous(unique_id);
  int32_t dev = device.type() == DeviceType::CUDA ? (device.index() >= 0 ? device.index() : 0) : -1;
  std::string b(backend);
  int64_t handle = 0;
  check(deep_ep_create_buffer(static_cast<const uint8_t*>(id.data_ptr()), id.numel(), rank, num_ranks, dev, num_nvl_bytes, num_rdma_bytes,
                              low_latency_mode ? 1 : 0, b.c_str(), &handle));
  return handle;
}

void destroy_buffer(int64_t handle) { check(deep_ep_destroy_buffer(handle)); }

void bind_buffer_slot(int64_t handle, int64_t slot) { check(deep_ep_bind_buffer_slot(handle, slot)); }

std::vector<int64_t> buffer_info_op(int64_t handle) {
  const char* op = "deep_ep::buffer_info";
  auto b = buffer_info(handle, op);
  int32_t whole_hooks = 0;
  check(deep_ep_ll_whole_hooks(handle, op, &whole_hooks));
  std::vector<int64_t> v(b.v, b.v + 7);
  v.push_back(whole_hooks);
  return v;
}

// A non-owning view (from_blob, no deleter: the stable ABI before torch 2.11 has none) of this
// rank's part of the buffer; the memory stays the buffer's, so destroying the buffer invalidates
// it (the Python Buffer keeps itself alive through the tensors it hands out).
Tensor get_local_buffer_tensor(int64_t handle, ScalarType dtype, int64_t offset, bool use_rdma_buffer) {
  const char* op = "deep_ep::get_local_buffer_tensor";
  auto info = buffer_info(handle, op);
  const auto shim_dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  const int64_t element_bytes = static_cast<int64_t>(aoti_torch_dtype_element_size(shim_dtype));
  const std::string name = dtype_name(dtype);
  void* data = nullptr;
  int64_t numel = 0;
  int32_t device = -1;
  check(deep_ep_get_local_buffer(handle, use_rdma_buffer ? 1 : 0, offset, element_bytes, name.c_str(), &data, &numel, &device));
  Device dev = device >= 0 ? Device(DeviceType::CUDA, static_cast<int8_t>(device)) : info.device();
  return torch::stable::from_blob(data, {numel}, {1}, dev, dtype);
}

int64_t nvl_hint(const IntList& config, int64_t hidden_bytes, int64_t num_ranks) {
  int64_t out = 0;
  check(deep_ep_buffer_size_hint(config.data(), config.size(), hidden_bytes, num_ranks, 0, &out));
  return out;
}

int64_t rdma_hint(const IntList& config, int64_t hidden_bytes, int64_t num_ranks) {
  int64_t out = 0;
  check(deep_ep_buffer_size_hint(config.data(), config.size(), hidden_bytes, num_ranks, 1, &out));
  return out;
}

int64_t ll_hint(int64_t t, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
  int64_t out = 0;
  check(deep_ep_low_latency_rdma_size_hint(t, hidden, num_ranks, num_experts, &out));
  return out;
}

std::string build_info() { return std::string(deep_ep_build_info()); }

int64_t nvl_domain_size() {
  int64_t out = 0;
  check(deep_ep_nvl_domain_size(&out));
  return out;
}

std::string check_environment(Device device) {
  int32_t dev = device.type() == DeviceType::CUDA ? (device.index() >= 0 ? device.index() : 0) : -1;
  char out[512] = {0};
  check(deep_ep_check_environment(dev, out, sizeof(out)));
  return std::string(out);
}

void ll_update_mask(int64_t handle, int64_t rank, bool mask) { check(deep_ep_ll_mask(handle, 0, rank, mask ? 1 : 0, nullptr, 0)); }

void ll_query_mask(int64_t handle, Tensor mask_status) {
  const char* op = "deep_ep::low_latency_query_mask_buffer";
  const int64_t r = buffer_info(handle, op).num_ranks();
  DEEP_EP_CHECK(mask_status.scalar_type() == ScalarType::Int && mask_status.dim() == 1 && mask_status.size(0) == r, op,
                ": mask_status must be a 1-D int32 tensor of num_ranks = ", r, " elements, got ",
                dtype_name(mask_status.scalar_type()), " of shape ", shape_of(mask_status));
  auto host = empty_on({r}, ScalarType::Int, Device(DeviceType::CPU));
  check(deep_ep_ll_mask(handle, 1, 0, 0, static_cast<int32_t*>(host.data_ptr()), r));
  torch::stable::copy_(mask_status, host);
}

void ll_clean_mask(int64_t handle) { check(deep_ep_ll_mask(handle, 2, 0, 0, nullptr, 0)); }

void ll_set_shrink(int64_t handle, bool enable) { check(deep_ep_ll_mask(handle, 3, 0, enable ? 1 : 0, nullptr, 0)); }

Tensor wait_stats(int64_t handle, bool reset) {
  const int64_t r = buffer_info(handle, "deep_ep::wait_stats").num_ranks();
  auto out = empty_on({r, 2}, ScalarType::Long, Device(DeviceType::CPU));
  torch::stable::zero_(out);
  check(deep_ep_wait_stats(handle, reset ? 1 : 0, static_cast<int64_t*>(out.data_ptr()), 2 * r));
  return out;
}

}  // namespace
}  // namespace deep_ep_ops

STABLE_TORCH_LIBRARY_IMPL(deep_ep, CompositeExplicitAutograd, m) {
  m.impl("get_unique_id", TORCH_BOX(&deep_ep_ops::get_unique_id));
  m.impl("create_buffer", TORCH_BOX(&deep_ep_ops::create_buffer));
  m.impl("destroy_buffer", TORCH_BOX(&deep_ep_ops::destroy_buffer));
  m.impl("bind_buffer_slot", TORCH_BOX(&deep_ep_ops::bind_buffer_slot));
  m.impl("buffer_info", TORCH_BOX(&deep_ep_ops::buffer_info_op));
  m.impl("get_local_buffer_tensor", TORCH_BOX(&deep_ep_ops::get_local_buffer_tensor));
  m.impl("nvl_buffer_size_hint", TORCH_BOX(&deep_ep_ops::nvl_hint));
  m.impl("rdma_buffer_size_hint", TORCH_BOX(&deep_ep_ops::rdma_hint));
  m.impl("low_latency_rdma_size_hint", TORCH_BOX(&deep_ep_ops::ll_hint));
  m.impl("build_info", TORCH_BOX(&deep_ep_ops::build_info));
  m.impl("nvl_domain_size", TORCH_BOX(&deep_ep_ops::nvl_domain_size));
  m.impl("check_environment", TORCH_BOX(&deep_ep_ops::check_environment));
  m.impl("low_latency_update_mask_buffer", TORCH_BOX(&deep_ep_ops::ll_update_mask));
  m.impl("low_latency_query_mask_buffer", TORCH_BOX(&deep_ep_ops::ll_query_mask));
  m.impl("low_latency_clean_mask_buffer", TORCH_BOX(&deep_ep_ops::ll_clean_mask));
  m.impl("low_latency_set_shrink", TORCH_BOX(&deep_ep_ops::ll_set_shrink));
  m.impl("wait_stats", TORCH_BOX(&deep_ep_ops::wait_stats));
}
