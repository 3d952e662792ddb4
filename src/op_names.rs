//! The name of every op as torch and error messages show it (`deep_ep::<op>`, the schema names
//! of `torch_ops/schema.cpp`): one home for validation (`ops`), the backends and the C API. A leaf
//! module: it imports nothing, so any layer may name an op.

/// `torch.ops.deep_ep.bind_buffer_slot`.
pub const BIND_BUFFER_SLOT: &str = "deep_ep::bind_buffer_slot";
/// `torch.ops.deep_ep.buffer_info`.
pub const BUFFER_INFO: &str = "deep_ep::buffer_info";
/// `torch.ops.deep_ep.build_info`.
pub const BUILD_INFO: &str = "deep_ep::build_info";
/// `torch.ops.deep_ep.cached_dispatch`.
pub const CACHED_DISPATCH: &str = "deep_ep::cached_dispatch";
/// `torch.ops.deep_ep.check_environment`.
pub const CHECK_ENVIRONMENT: &str = "deep_ep::check_environment";
/// `torch.ops.deep_ep.clean_low_latency_buffer`.
pub const CLEAN_LOW_LATENCY_BUFFER: &str = "deep_ep::clean_low_latency_buffer";
/// `torch.ops.deep_ep.combine`.
pub const COMBINE: &str = "deep_ep::combine";
/// `torch.ops.deep_ep.create_buffer`.
pub const CREATE_BUFFER: &str = "deep_ep::create_buffer";
/// `torch.ops.deep_ep.destroy_buffer`.
pub const DESTROY_BUFFER: &str = "deep_ep::destroy_buffer";
/// `torch.ops.deep_ep.dispatch`.
pub const DISPATCH: &str = "deep_ep::dispatch";
/// `torch.ops.deep_ep.get_dispatch_layout`.
pub const GET_DISPATCH_LAYOUT: &str = "deep_ep::get_dispatch_layout";
/// `torch.ops.deep_ep.get_local_buffer_tensor`.
pub const GET_LOCAL_BUFFER_TENSOR: &str = "deep_ep::get_local_buffer_tensor";
/// `torch.ops.deep_ep.get_next_low_latency_combine_buffer`.
pub const GET_NEXT_LOW_LATENCY_COMBINE_BUFFER: &str = "deep_ep::get_next_low_latency_combine_buffer";
/// `torch.ops.deep_ep.get_unique_id`.
pub const GET_UNIQUE_ID: &str = "deep_ep::get_unique_id";
/// `torch.ops.deep_ep.internode_cached_dispatch`.
pub const INTERNODE_CACHED_DISPATCH: &str = "deep_ep::internode_cached_dispatch";
/// `torch.ops.deep_ep.internode_combine`.
pub const INTERNODE_COMBINE: &str = "deep_ep::internode_combine";
/// `torch.ops.deep_ep.internode_dispatch`.
pub const INTERNODE_DISPATCH: &str = "deep_ep::internode_dispatch";
/// `torch.ops.deep_ep.low_latency_clean_mask_buffer`.
pub const LOW_LATENCY_CLEAN_MASK_BUFFER: &str = "deep_ep::low_latency_clean_mask_buffer";
/// `torch.ops.deep_ep.low_latency_combine`.
pub const LOW_LATENCY_COMBINE: &str = "deep_ep::low_latency_combine";
/// `torch.ops.deep_ep.low_latency_combine_recv`.
pub const LOW_LATENCY_COMBINE_RECV: &str = "deep_ep::low_latency_combine_recv";
/// `torch.ops.deep_ep.low_latency_combine_send`.
pub const LOW_LATENCY_COMBINE_SEND: &str = "deep_ep::low_latency_combine_send";
/// `torch.ops.deep_ep.low_latency_dispatch`.
pub const LOW_LATENCY_DISPATCH: &str = "deep_ep::low_latency_dispatch";
/// `torch.ops.deep_ep.low_latency_dispatch_recv`.
pub const LOW_LATENCY_DISPATCH_RECV: &str = "deep_ep::low_latency_dispatch_recv";
/// `torch.ops.deep_ep.low_latency_dispatch_send`.
pub const LOW_LATENCY_DISPATCH_SEND: &str = "deep_ep::low_latency_dispatch_send";
/// `torch.ops.deep_ep.low_latency_query_mask_buffer`.
pub const LOW_LATENCY_QUERY_MASK_BUFFER: &str = "deep_ep::low_latency_query_mask_buffer";
/// `torch.ops.deep_ep.low_latency_rdma_size_hint`.
pub const LOW_LATENCY_RDMA_SIZE_HINT: &str = "deep_ep::low_latency_rdma_size_hint";
/// `torch.ops.deep_ep.low_latency_set_shrink`.
pub const LOW_LATENCY_SET_SHRINK: &str = "deep_ep::low_latency_set_shrink";
/// `torch.ops.deep_ep.low_latency_update_mask_buffer`.
pub const LOW_LATENCY_UPDATE_MASK_BUFFER: &str = "deep_ep::low_latency_update_mask_buffer";
/// `torch.ops.deep_ep.nvl_buffer_size_hint`.
pub const NVL_BUFFER_SIZE_HINT: &str = "deep_ep::nvl_buffer_size_hint";
/// `torch.ops.deep_ep.nvl_domain_size`.
pub const NVL_DOMAIN_SIZE: &str = "deep_ep::nvl_domain_size";
/// `torch.ops.deep_ep.rdma_buffer_size_hint`.
pub const RDMA_BUFFER_SIZE_HINT: &str = "deep_ep::rdma_buffer_size_hint";
/// `torch.ops.deep_ep.wait_stats`.
pub const WAIT_STATS: &str = "deep_ep::wait_stats";
