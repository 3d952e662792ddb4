"""Fake (meta) kernels of every deep_ep op, for torch.compile, FakeTensor and opcheck.

Shapes follow torch_ops/schema.cpp. The receive count of a non-cached normal dispatch depends on
the data, so it is a dynamic size; everything else is static. Ops whose shapes depend on the
buffer (its rank count) read it through buffer_info outside fake mode: it is a host-side lookup.
"""
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from . import _lib

_lib.load()
ops = torch.ops.deep_ep
LL_STATE_LEN = 4


def _tensors(names, args, kwargs):
    """(argument name as the schema spells it, tensor) of every tensor argument, lists included."""
    for name, v in list(zip(names, args)) + list(kwargs.items()):
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(t, torch.Tensor):
                yield name, t


def _fake(op):
    """torch.library.register_fake for deep_ep::`op`, refusing a real call that mixes meta tensors
    with tensors on a device: one meta tensor sends the whole call to this shape-only kernel, which
    would return uninitialised outputs and move no data (FakeTensors, torch.compile's, are not meta
    and pass; a call with only meta tensors is shape inference and passes)."""
    names = [a.name for a in getattr(ops, op).default._schema.arguments]

    def register(fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            ts = list(_tensors(names, args, kwargs))
            meta = next((n for n, t in ts if t.device.type == "meta" and not isinstance(t, FakeTensor)), None)
            real = next(((n, t.device) for n, t in ts if t.device.type != "meta" and not isinstance(t, FakeTensor)), None)
            if meta is not None and real is not None:
                raise RuntimeError(f"deep_ep::{op}: {meta} is on the meta device but {real[0]} is on {real[1]}: every tensor of the call "
                                   "must be on the buffer's device (a meta tensor would run only the shape function: no data moved)")
            return fn(*args, **kwargs)

        return torch.library.register_fake(f"deep_ep::{op}")(checked)

    return register


def _num_ranks(handle: int) -> int:
    with unset_fake_temporarily():
        return int(ops.buffer_info.default(handle)[1])


def _device(handle: int) -> torch.device:
    with unset_fake_temporarily():
        d = int(ops.buffer_info.default(handle)[2])
    return torch.device("cpu") if d < 0 else torch.device("cuda", d)


def _domain() -> int:
    """Ranks per NVLink domain (DEEP_EP_NVL_DOMAIN_SIZE, default 8), from the library's one parser:
    a malformed value raises here, while tracing, as the real op would, instead of tracing a shape
    the op will not produce."""
    with unset_fake_temporarily():
        return int(ops.nvl_domain_size.default())


def _rows_of(t, rows, x, absent_dtype):
    """[rows, t.shape[1]] like t, or the empty placeholder an absent optional output is."""
    return t.new_empty((rows, t.shape[1])) if t is not None else x.new_empty((0,), dtype=absent_dtype)


def _received(x, x_scales, topk_idx, topk_weights, rows):
    """recv_x, scales, topk_idx and topk_weights of a (normal or internode) dispatch of `rows` rows."""
    return (x.new_empty((rows, x.shape[1])), _rows_of(x_scales, rows, x, torch.float32), _rows_of(topk_idx, rows, x, torch.int64),
            _rows_of(topk_weights, rows, x, torch.float32))


@_fake("get_dispatch_layout")
def _layout(topk_idx, num_experts, num_ranks):
    n = topk_idx.shape[0]
    i32 = torch.int32
    d = _domain()
    return (
        topk_idx.new_empty((num_ranks,), dtype=i32),
        topk_idx.new_empty((num_ranks // d if num_ranks > d else 0,), dtype=i32),
        topk_idx.new_empty((num_experts,), dtype=i32),
        topk_idx.new_empty((n, num_ranks), dtype=torch.bool),
    )


@_fake("dispatch")
def _dispatch(handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
              num_tokens_per_expert, expert_alignment, num_worst_tokens, config):
    r = num_tokens_per_rank.shape[0]
    e = num_tokens_per_expert.shape[0]
    c = config[0] // 2
    n = x.shape[0]
    rows = num_worst_tokens if num_worst_tokens > 0 else torch.library.get_ctx().new_dynamic_size()
    i32 = torch.int32
    per_expert = torch.empty((e // r if num_worst_tokens == 0 else 0,), dtype=i32, device="cpu")
    return (
        *_received(x, x_scales, topk_idx, topk_weights, rows), per_expert,
        x.new_empty((r, r), dtype=i32), x.new_empty((r, c), dtype=i32), x.new_empty((r, c), dtype=i32),
        x.new_empty((rows,), dtype=i32), x.new_empty((n, r), dtype=i32),
    )


@_fake("cached_dispatch")
def _cached(handle, x, x_scales, rpm, cpm, rcpm, recv_src_idx, is_token_in_rank, send_head, config):
    rows = recv_src_idx.shape[0]
    return x.new_empty((rows, x.shape[1])), _rows_of(x_scales, rows, x, torch.float32)


@_fake("combine")
def _combine(handle, x, topk_weights, bias_0, bias_1, rpm, cpm, rcpm, recv_src_idx, is_token_in_rank, send_head, config):
    n = send_head.shape[0]
    return x.new_empty((n, x.shape[1])), _rows_of(topk_weights, n, x, torch.float32)


@_fake("internode_dispatch")
def _internode_dispatch(handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
                        is_token_in_rank, num_tokens_per_expert, expert_alignment, num_worst_tokens, config):
    r, rr = num_tokens_per_rank.shape[0], num_tokens_per_rdma_rank.shape[0]
    e = num_tokens_per_expert.shape[0]
    c = config[0] // 2
    n = x.shape[0]
    ctx = torch.library.get_ctx() if num_worst_tokens == 0 else None
    rows = num_worst_tokens if num_worst_tokens > 0 else ctx.new_dynamic_size()
    rdma_rows = num_worst_tokens if num_worst_tokens > 0 else ctx.new_dynamic_size()
    i32 = torch.int32
    per_expert = torch.empty((e // r if num_worst_tokens == 0 else 0,), dtype=i32, device="cpu")
    return (
        *_received(x, x_scales, topk_idx, topk_weights, rows), per_expert,
        x.new_empty((rr, c), dtype=i32), x.new_empty((r, c), dtype=i32), x.new_empty((rr, c), dtype=i32),
        x.new_empty((rr,), dtype=i32), x.new_empty((r, c), dtype=i32), x.new_empty((r,), dtype=i32),
        x.new_empty((rows, 8), dtype=torch.uint8), x.new_empty((n, rr), dtype=i32), x.new_empty((rdma_rows, 8), dtype=i32),
    )


@_fake("internode_cached_dispatch")
def _internode_cached(handle, x, x_scales, is_token_in_rank, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm,
                      recv_gbl_rps, recv_src_meta, send_rdma_head, send_nvl_head, config):
    rows = recv_src_meta.shape[0]
    return x.new_empty((rows, x.shape[1])), _rows_of(x_scales, rows, x, torch.float32)


@_fake("internode_combine")
def _internode_combine(handle, x, topk_weights, bias_0, bias_1, is_token_in_rank, rdma_cpm, gbl_cpm, recv_rdma_cpm,
                       recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps, recv_src_meta, send_rdma_head, send_nvl_head, config):
    n = is_token_in_rank.shape[0]
    return x.new_empty((n, x.shape[1])), _rows_of(topk_weights, n, x, torch.float32)


def _ll_outputs(handle, x, t, e, use_fp8, use_ue8m0, use_nvfp4=False):
    r = _num_ranks(handle)
    el, rows, h = e // r, r * t, x.shape[1]
    if use_nvfp4:  # physical NVFP4 layouts (docs/NVFP4.md)
        recv_x = x.new_empty((el, rows, h // 2), dtype=torch.uint8)
        scales = x.new_empty((el, (rows + 127) // 128, h // 64, 512), dtype=torch.float8_e4m3fn)
        return (recv_x, scales, x.new_empty((el,), dtype=torch.int32), x.new_empty((el, rows), dtype=torch.int32),
                x.new_empty((el, r), dtype=torch.int64))
    recv_x = x.new_empty((el, rows, h), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    if use_fp8:
        cols, dt = (h // 512, torch.int32) if use_ue8m0 else (h // 128, torch.float32)
        scales = x.new_empty((el, cols, rows), dtype=dt).transpose(1, 2)
    else:
        scales = x.new_empty((0,), dtype=torch.float32)
    return (recv_x, scales, x.new_empty((el,), dtype=torch.int32), x.new_empty((el, rows), dtype=torch.int32),
            x.new_empty((el, r), dtype=torch.int64))


@_fake("low_latency_dispatch")
def _ll_dispatch(handle, x, topk_idx, topk_weights, cumulative, wait, t, e, use_fp8, round_scale, use_ue8m0, num_tokens=None,
                 use_nvfp4=False, x_global_scale=None):
    return _ll_outputs(handle, x, t, e, use_fp8, use_ue8m0, use_nvfp4)


@_fake("low_latency_dispatch_send")
def _ll_dispatch_send(handle, x, topk_idx, topk_weights, t, e, use_fp8, round_scale, use_ue8m0, num_tokens=None, use_nvfp4=False,
                      x_global_scale=None):
    return _ll_outputs(handle, x, t, e, use_fp8, use_ue8m0, use_nvfp4) + (x.new_empty((LL_STATE_LEN,), dtype=torch.int64),)


@_fake("low_latency_dispatch_recv")
def _ll_dispatch_recv(handle, state, recv_x, scales, count, src_info, layout_range, cumulative, wait, t, e, use_fp8, round_scale, use_ue8m0,
                      use_nvfp4=False):
    return None


@_fake("low_latency_combine")
def _ll_combine(handle, x, topk_idx, topk_weights, src_info, layout_range, out, wait, t, e, use_logfmt, zero_copy, num_tokens=None,
                comp_signal=None, block_m=64, threshold=0, num_sms=0):
    return None


@_fake("low_latency_combine_alloc")
def _ll_combine_alloc(handle, x, topk_idx, topk_weights, src_info, layout_range, wait, t, e, use_logfmt, zero_copy, num_tokens=None,
                      comp_signal=None, block_m=64, threshold=0, num_sms=0):
    return x.new_empty((min(topk_idx.size(0), t), x.size(-1)), dtype=torch.bfloat16)


@_fake("low_latency_combine_send")
def _ll_combine_send(handle, x, src_info, layout_range, t, e, use_logfmt, zero_copy, comp_signal=None, block_m=64, threshold=0,
                     num_sms=0):
    return x.new_empty((LL_STATE_LEN,), dtype=torch.int64)


@_fake("low_latency_combine_recv")
def _ll_combine_recv(handle, state, topk_idx, topk_weights, out, wait, t, hidden, e, num_tokens=None):
    return None


@_fake("get_next_low_latency_combine_buffer")
def _ll_next(handle, t, hidden, e):
    r = _num_ranks(handle)
    m = hidden + hidden // 128 * 2
    return torch.empty_strided((e // r, r * t, hidden), (r * t * m, m, 1), dtype=torch.bfloat16, device=_device(handle))


@_fake("get_local_buffer_tensor")
def _local_buffer(handle, dtype, offset=0, use_rdma_buffer=False):
    with unset_fake_temporarily():
        info = [int(v) for v in ops.buffer_info.default(handle)]
    nbytes = info[4] if use_rdma_buffer else info[3]
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    return torch.empty((max(nbytes - offset, 0) // itemsize,), dtype=dtype, device=_device(handle))


@_fake("low_latency_query_mask_buffer")
def _ll_query_mask(handle, mask_status):
    return None


@_fake("wait_stats")
def _wait_stats(handle, reset=False):
    return torch.empty((_num_ranks(handle), 2), dtype=torch.int64, device="cpu")


# Collective ops must never be dropped or reordered by graph passes, even when an output is unused;
# neither may the local ops that change the rank mask.
for _name in ("dispatch", "cached_dispatch", "combine", "internode_dispatch", "internode_cached_dispatch", "internode_combine",
              "low_latency_dispatch", "low_latency_dispatch_send",
              "low_latency_dispatch_recv", "low_latency_combine", "low_latency_combine_alloc", "low_latency_combine_send",
              "low_latency_combine_recv", "clean_low_latency_buffer", "low_latency_update_mask_buffer", "low_latency_query_mask_buffer",
              "low_latency_clean_mask_buffer", "low_latency_set_shrink", "bind_buffer_slot"):
    try:
        torch.fx.node.has_side_effect(getattr(ops, _name).default)
    except AttributeError:  # older torch: the op is still kept when its outputs are used
        pass
