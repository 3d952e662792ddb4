// Buffer lifecycle, size hints, rank masking and wait statistics. These take no device tensors, so they are registered for
// CompositeExplicitAutograd (any device, no autograd).
#include "common.h"

namespace deep_ep_ops {
namespace {

at::Tensor get_unique_id(c10::string_view backend, std::optional<at::Device> device) {
  auto id = at::empty({DEEP_EP_UNIQUE_ID_BYTES}, at::TensorOptions().dtype(at::kByte));
  int32_t dev = (device.has_value() && device->is_cuda()) ? device->index() : -1;
  if (device.has_value() && device->is_cuda() && dev < 0) dev = 0;
  std::string b(backend);
  check(deep_ep_get_unique_id(b.c_str(), dev, id.data_ptr<uint8_t>()));
  return id;
}

int64_t create_buffer(const at::Tensor& unique_id, int64_t rank, int64_t num_ranks, at::Device device, int64_t num_nvl_bytes,
                      int64_t num_rdma_bytes, bool low_latency_mode, c10::string_view backend) {
  TORCH_CHECK(unique_id.device().is_cpu() && unique_id.scalar_type() == at::kByte && unique_id.dim() == 1,
              "deep_ep::create_buffer: unique_id must be a 1-D uint8 CPU tensor from get_unique_id, got ", unique_id.scalar_type(),
              " of shape ", unique_id.sizes(), " on ", unique_id.device());
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "deep_ep::create_buffer: device must be cpu or cuda, got ", device);
  auto id = unique_id.contiguous();
  int32_t dev = device.is_cuda() ? (device.has_index() ? device.index() : 0) : -1;
  std::string b(backend);
  int64_t handle = 0;
  check(deep_ep_create_buffer(id.data_ptr<uint8_t>(), id.numel(), rank, num_ranks, dev, num_nvl_bytes, num_rdma_bytes,
                              low_latency_mode ? 1 : 0, b.c_str(), &handle));
  return handle;
}

void destroy_buffer(int64_t handle) { check(deep_ep_destroy_buffer(handle)); }

std::vector<int64_t> buffer_info_op(int64_t handle) {
  auto b = buffer_info(handle, "deep_ep::buffer_info");
  return std::vector<int64_t>(b.v, b.v + 7);
}

int64_t nvl_hint(at::IntArrayRef config, int64_t hidden_bytes, int64_t num_ranks) {
  int64_t out = 0;
  check(deep_ep_buffer_size_hint(config.data(), config.size(), hidden_bytes, num_ranks, 0, &out));
  return out;
}

int64_t rdma_hint(at::IntArrayRef config, int64_t hidden_bytes, int64_t num_ranks) {
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

void ll_update_mask(int64_t handle, int64_t rank, bool mask) { check(deep_ep_ll_mask(handle, 0, rank, mask ? 1 : 0, nullptr, 0)); }

void ll_query_mask(int64_t handle, const at::Tensor& mask_status) {
  const char* op = "deep_ep::low_latency_query_mask_buffer";
  const int64_t r = buffer_info(handle, op).num_ranks();
  TORCH_CHECK(mask_status.scalar_type() == at::kInt && mask_status.dim() == 1 && mask_status.size(0) == r, op,
              ": mask_status must be a 1-D int32 tensor of num_ranks = ", r, " elements, got ", mask_status.scalar_type(), " of shape ",
              mask_status.sizes());
  auto host = at::empty({r}, at::TensorOptions().dtype(at::kInt));
  check(deep_ep_ll_mask(handle, 1, 0, 0, host.data_ptr<int32_t>(), r));
  mask_status.copy_(host);
}

void ll_clean_mask(int64_t handle) { check(deep_ep_ll_mask(handle, 2, 0, 0, nullptr, 0)); }

void ll_set_shrink(int64_t handle, bool enable) { check(deep_ep_ll_mask(handle, 3, 0, enable ? 1 : 0, nullptr, 0)); }

at::Tensor wait_stats(int64_t handle, bool reset) {
  const int64_t r = buffer_info(handle, "deep_ep::wait_stats").num_ranks();
  auto out = at::zeros({r, 2}, at::TensorOptions().dtype(at::kLong));
  check(deep_ep_wait_stats(handle, reset ? 1 : 0, out.data_ptr<int64_t>(), 2 * r));
  return out;
}

}  // namespace
}  // namespace deep_ep_ops

TORCH_LIBRARY_IMPL(deep_ep, CompositeExplicitAutograd, m) {
  m.impl("get_unique_id", &deep_ep_ops::get_unique_id);
  m.impl("create_buffer", &deep_ep_ops::create_buffer);
  m.impl("destroy_buffer", &deep_ep_ops::destroy_buffer);
  m.impl("buffer_info", &deep_ep_ops::buffer_info_op);
  m.impl("nvl_buffer_size_hint", &deep_ep_ops::nvl_hint);
  m.impl("rdma_buffer_size_hint", &deep_ep_ops::rdma_hint);
  m.impl("low_latency_rdma_size_hint", &deep_ep_ops::ll_hint);
  m.impl("build_info", &deep_ep_ops::build_info);
  m.impl("low_latency_update_mask_buffer", &deep_ep_ops::ll_update_mask);
  m.impl("low_latency_query_mask_buffer", &deep_ep_ops::ll_query_mask);
  m.impl("low_latency_clean_mask_buffer", &deep_ep_ops::ll_clean_mask);
  m.impl("low_latency_set_shrink", &deep_ep_ops::ll_set_shrink);
  m.impl("wait_stats", &deep_ep_ops::wait_stats);
}
