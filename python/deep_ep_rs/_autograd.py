"""Autograd formulas of the normal-mode ops (torch.library.register_autograd).

dispatch copies each token row to the ranks of its experts, and combine sums the rows back, so
each is the other's adjoint. The same holds for the cached dispatch (a dispatch reusing a handle)
and for the internode ops (ranks spanning several NVLink domains), so every differentiable op has
autograd: ``dispatch``, ``cached_dispatch``, ``combine``, ``internode_dispatch``,
``internode_cached_dispatch`` and ``internode_combine``.

- ``deep_ep::dispatch`` is differentiable w.r.t. ``x`` (BF16 only: an FP8 ``x`` with scales is
  not differentiable and asking for its gradient raises) and ``topk_weights``. The gradient of
  ``recv_x`` goes back through ``combine`` with the handle this dispatch returned (an unweighted
  fp32 sum over ranks, rounded to bf16 like ``x``). The gradient of ``recv_topk_weights`` goes back
  through the same combine, masked to the entries dispatch copied (``recv_topk_idx >= 0``: entries
  of experts on other ranks are zeroed by dispatch and carry no gradient). Worst-case padding rows
  (``recv_src_idx == -1``) carry no gradient; they are zeroed before the combine.
- ``deep_ep::cached_dispatch`` is differentiable w.r.t. ``x`` (BF16 only, as dispatch; ``x_scales``
  are not differentiable): the gradient of ``recv_x`` goes back through ``combine`` with the same
  handle, padding rows zeroed.
- ``deep_ep::combine`` is differentiable w.r.t. ``x``, ``topk_weights``, ``bias_0`` and ``bias_1``.
  The gradient of ``combined_x`` goes back through ``cached_dispatch`` with the cached handle (a
  copy back to every contributing row); the gradient of ``combined_topk_weights`` ([N, K] f32) is
  sent through the same ``cached_dispatch`` bit-exactly, viewed as a bf16 row tensor; each bias
  gets ``grad_combined_x`` as is. Rows without a source (worst-case padding) get zero gradient.
- ``deep_ep::internode_dispatch`` / ``internode_cached_dispatch`` / ``internode_combine``: the same
  formulas with the internode ops and the 10-tensor internode handle (the backward of an
  internode dispatch is an ``internode_combine``: per NVLink domain a bf16-rounded fp32 partial,
  as the forward combine sums). Worst-case padding rows are the rows whose ``recv_src_meta`` is
  all zero (a received row names at least its receiving rank). internode_combine refuses NVLink
  chunk sizes that dispatch accepts (``num_max_nvl_chunked_recv_tokens`` must be a multiple of
  the domains and ``num_max_nvl_chunked_send_tokens`` at most that over the domains), so the
  backward of an internode dispatch runs its combine with the dispatch's config brought within
  those bounds (same ``num_sms``, i.e. the handle's channels; the chunk sizes change no result).

Backward calls are collectives, like the forward ones: every rank of the buffer must run the
backward of the same ops in the same order. A MoE training step in which every rank calls
``loss.backward()`` once through the same layers does that naturally (autograd runs backward in
reverse order of the forward). A rank whose outputs do not reach its loss would skip the
collective and hang its peers (until the library's timeout): make every rank's loss depend on
the layer output (e.g. ``loss + 0 * out.sum()``) if that can happen.
"""
import torch

from . import _lib

_lib.load()
ops = torch.ops.deep_ep

#: cached_dispatch carries rows of bf16; weight gradients travel as f32 bits padded to this many bf16 columns.
_ROW_ALIGN = 64


def _check_not_fp8(op, x, x_scales):
    if x_scales is not None and isinstance(x, torch.Tensor) and x.requires_grad:
        raise RuntimeError(f"deep_ep::{op}: an FP8 x (with x_scales) is not differentiable; "
                           "detach it or dispatch BF16 to get gradients")


def _intranode_real(src_idx):
    """[rows, 1]: the received rows of an intranode handle (worst-case padding has recv_src_idx == -1)."""
    return (src_idx >= 0).unsqueeze(1)


def _internode_real(recv_src_meta):
    """[rows, 1]: the received rows of an internode handle (worst-case padding rows have an all-zero
    recv_src_meta; a received row names at least its receiving rank)."""
    return recv_src_meta.ne(0).any(dim=1, keepdim=True)


def _internode_combine_config(config, num_rdma_ranks):
    """A dispatch config for internode_combine: same num_sms (the handle's channels), the NVLink
    chunk sizes brought within combine's bounds (num_max_nvl_chunked_recv_tokens a multiple of the
    domains, num_max_nvl_chunked_send_tokens at most recv / domains). Chunking changes no result."""
    sms, nvl_send, nvl_recv, rdma_send, rdma_recv = config
    recv = nvl_recv - nvl_recv % num_rdma_ranks
    if recv >= num_rdma_ranks:  # else left as is: the library names the problem
        nvl_recv, nvl_send = recv, min(nvl_send, recv // num_rdma_ranks)
    return [sms, nvl_send, nvl_recv, rdma_send, rdma_recv]


def _masked_bf16(real, grad):
    return torch.where(real, grad, torch.zeros_like(grad)).to(torch.bfloat16).contiguous()


def _f32_as_bf16_rows(t):
    """f32 [N, K] -> its bits as bf16 [N, 2K padded to _ROW_ALIGN], and 2K."""
    n, k = t.shape
    cols = 2 * k
    padded = -(-cols // _ROW_ALIGN) * _ROW_ALIGN
    bits = t.float().contiguous().view(torch.bfloat16)  # [N, 2K]
    if padded != cols:
        bits = torch.cat([bits, bits.new_zeros((n, padded - cols))], dim=1)
    return bits.contiguous(), cols


def cached_dispatch_rows_f32(handle, t, rpm, cpm, rcpm, src_idx, in_rank, send_head, config):
    """cached_dispatch of an f32 [N, K] tensor, bit-exact: the f32 bits travel as bf16 columns."""
    bits, cols = _f32_as_bf16_rows(t)
    recv, _ = ops.cached_dispatch(handle, bits, None, rpm, cpm, rcpm, src_idx, in_rank, send_head, config)
    return recv[:, :cols].contiguous().view(torch.float32)


def internode_cached_dispatch_rows_f32(handle, t, internode_handle, config):
    """internode_cached_dispatch of an f32 [N, K] tensor with the 10-tensor internode handle, bit-exact."""
    bits, cols = _f32_as_bf16_rows(t)
    recv, _ = ops.internode_cached_dispatch(handle, bits, None, *internode_handle, config)
    return recv[:, :cols].contiguous().view(torch.float32)


# ---------------------------------------------------------------------------------------------
# dispatch (backward: combine)


def _combine_operands(ctx, op, real, grad_recv_x, grad_recv_w, recv_idx):
    """The rows a dispatch's backward combines: grad_recv_x (padding rows zeroed, bf16) and, when
    topk_weights need a gradient, grad_recv_topk_weights masked to the copied entries (f32)."""
    if grad_recv_x is None:
        raise RuntimeError(f"deep_ep::{op} backward: no gradient for recv_x (internal error)")
    gx = _masked_bf16(real, grad_recv_x)
    gw = None
    if ctx.has_weights and ctx.needs_input_grad[4]:
        if grad_recv_w is None:
            gw = torch.zeros((gx.shape[0], recv_idx.shape[1]), dtype=torch.float32, device=gx.device)
        else:
            gw = torch.where(recv_idx >= 0, grad_recv_w.float(), torch.zeros_like(grad_recv_w, dtype=torch.float32))
            gw = gw.contiguous()
    return gx, gw


def _dispatch_setup(ctx, inputs, output):
    (handle, x, x_scales, topk_idx, topk_weights, _ntpr, is_token_in_rank, _ntpe, _align, _worst, config) = inputs
    _check_not_fp8("dispatch", x, x_scales)
    recv_x, _, recv_idx, _, _, rpm, cpm, rcpm, src_idx, send_head = output
    ctx.handle, ctx.config = handle, list(config)
    ctx.has_weights = topk_weights is not None
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head,
                          recv_idx if topk_idx is not None else None)


def _dispatch_backward(ctx, grad_recv_x, grad_recv_scales, grad_recv_idx, grad_recv_w, grad_per_expert,
                       *grad_handle):
    rpm, cpm, rcpm, src_idx, in_rank, send_head, recv_idx = ctx.saved_tensors
    gx, gw = _combine_operands(ctx, "dispatch", _intranode_real(src_idx), grad_recv_x, grad_recv_w, recv_idx)
    cx, cw = ops.combine(ctx.handle, gx, gw, None, None, rpm, cpm, rcpm, src_idx, in_rank, send_head, ctx.config)
    grad_x = cx.to(ctx.x_dtype) if ctx.needs_input_grad[1] else None
    return None, grad_x, None, None, cw if gw is not None else None, None, None, None, None, None, None


def _internode_dispatch_setup(ctx, inputs, output):
    (handle, x, x_scales, topk_idx, topk_weights, _ntpr, _ntprr, is_token_in_rank, _ntpe, _align, _worst, config) = inputs
    _check_not_fp8("internode_dispatch", x, x_scales)
    recv_x, _, recv_idx, _, _, *rest = output  # rest: the internode handle without is_token_in_rank
    ctx.handle, ctx.config = handle, list(config)
    ctx.has_weights = topk_weights is not None
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(is_token_in_rank, *rest, recv_idx if topk_idx is not None else None)


def _internode_dispatch_backward(ctx, grad_recv_x, grad_recv_scales, grad_recv_idx, grad_recv_w, grad_per_expert,
                                 *grad_handle):
    *ih, recv_idx = ctx.saved_tensors
    gx, gw = _combine_operands(ctx, "internode_dispatch", _internode_real(ih[7]), grad_recv_x, grad_recv_w, recv_idx)
    cx, cw = ops.internode_combine(ctx.handle, gx, gw, None, None, *ih, _internode_combine_config(ctx.config, ih[4].shape[0]))
    grad_x = cx.to(ctx.x_dtype) if ctx.needs_input_grad[1] else None
    return (None, grad_x, None, None, cw if gw is not None else None) + (None,) * 7


# ---------------------------------------------------------------------------------------------
# cached dispatch (backward: combine)


def _cached_dispatch_setup(ctx, inputs, output):
    (handle, x, x_scales, rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head, config) = inputs
    _check_not_fp8("cached_dispatch", x, x_scales)
    ctx.handle, ctx.config = handle, list(config)
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head)


def _cached_dispatch_backward(ctx, grad_recv_x, grad_recv_scales):
    if not ctx.needs_input_grad[1]:  # only x_scales required grad: not differentiable
        return (None,) * 10
    rpm, cpm, rcpm, src_idx, in_rank, send_head = ctx.saved_tensors
    gx = _masked_bf16(_intranode_real(src_idx), grad_recv_x)
    cx, _ = ops.combine(ctx.handle, gx, None, None, None, rpm, cpm, rcpm, src_idx, in_rank, send_head, ctx.config)
    return (None, cx.to(ctx.x_dtype)) + (None,) * 8


def _internode_cached_dispatch_setup(ctx, inputs, output):
    (handle, x, x_scales, *ih, config) = inputs  # ih: the 10-tensor internode handle
    _check_not_fp8("internode_cached_dispatch", x, x_scales)
    ctx.handle, ctx.config = handle, list(config)
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(*ih)


def _internode_cached_dispatch_backward(ctx, grad_recv_x, grad_recv_scales):
    if not ctx.needs_input_grad[1]:
        return (None,) * 14
    ih = ctx.saved_tensors
    gx = _masked_bf16(_internode_real(ih[7]), grad_recv_x)
    cx, _ = ops.internode_combine(ctx.handle, gx, None, None, None, *ih, _internode_combine_config(ctx.config, ih[4].shape[0]))
    return (None, cx.to(ctx.x_dtype)) + (None,) * 12


# ---------------------------------------------------------------------------------------------
# combine (backward: cached dispatch)


def _combine_setup_common(ctx, handle, x, topk_weights, bias_0, bias_1, config):
    ctx.handle, ctx.config = handle, list(config)
    ctx.x_dtype = x.dtype
    ctx.w_dtype = topk_weights.dtype if topk_weights is not None else None
    ctx.bias_dtypes = (bias_0.dtype if bias_0 is not None else None, bias_1.dtype if bias_1 is not None else None)


def _combine_grads(ctx, grad_cx, grad_cw, real, cached_x, cached_w_f32):
    """grad x, topk_weights, bias_0, bias_1 of a combine: `cached_x(bf16 rows)` and
    `cached_w_f32(f32 rows)` are the cached dispatches of its handle."""
    need = ctx.needs_input_grad
    grad_x = grad_w = None
    if need[1]:
        recv = cached_x(grad_cx.to(torch.bfloat16).contiguous())
        grad_x = torch.where(real, recv, torch.zeros_like(recv)).to(ctx.x_dtype)
    if need[2] and ctx.w_dtype is not None and grad_cw is not None and grad_cw.numel() > 0:
        recv_w = cached_w_f32(grad_cw)
        grad_w = torch.where(real, recv_w, torch.zeros_like(recv_w)).to(ctx.w_dtype)
    gb0 = grad_cx.to(ctx.bias_dtypes[0]) if need[3] and ctx.bias_dtypes[0] is not None else None
    gb1 = grad_cx.to(ctx.bias_dtypes[1]) if need[4] and ctx.bias_dtypes[1] is not None else None
    return grad_x, grad_w, gb0, gb1


def _combine_setup(ctx, inputs, output):
    (handle, x, topk_weights, bias_0, bias_1, rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head, config) = inputs
    _combine_setup_common(ctx, handle, x, topk_weights, bias_0, bias_1, config)
    ctx.save_for_backward(rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head)


def _combine_backward(ctx, grad_cx, grad_cw):
    hd = ctx.saved_tensors

    def cached_x(rows):
        return ops.cached_dispatch(ctx.handle, rows, None, *hd, ctx.config)[0]

    grads = _combine_grads(ctx, grad_cx, grad_cw, _intranode_real(hd[3]), cached_x,
                           lambda t: cached_dispatch_rows_f32(ctx.handle, t, *hd, ctx.config))
    return (None, *grads) + (None,) * 7


def _internode_combine_setup(ctx, inputs, output):
    (handle, x, topk_weights, bias_0, bias_1, *ih, config) = inputs  # ih: the 10-tensor internode handle
    _combine_setup_common(ctx, handle, x, topk_weights, bias_0, bias_1, config)
    ctx.save_for_backward(*ih)


def _internode_combine_backward(ctx, grad_cx, grad_cw):
    ih = ctx.saved_tensors

    def cached_x(rows):
        return ops.internode_cached_dispatch(ctx.handle, rows, None, *ih, ctx.config)[0]

    grads = _combine_grads(ctx, grad_cx, grad_cw, _internode_real(ih[7]), cached_x,
                           lambda t: internode_cached_dispatch_rows_f32(ctx.handle, t, ih, ctx.config))
    return (None, *grads) + (None,) * 11


torch.library.register_autograd("deep_ep::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("deep_ep::cached_dispatch", _cached_dispatch_backward, setup_context=_cached_dispatch_setup)
torch.library.register_autograd("deep_ep::combine", _combine_backward, setup_context=_combine_setup)
torch.library.register_autograd("deep_ep::internode_dispatch", _internode_dispatch_backward,
                                setup_context=_internode_dispatch_setup)
torch.library.register_autograd("deep_ep::internode_cached_dispatch", _internode_cached_dispatch_backward,
                                setup_context=_internode_cached_dispatch_setup)
torch.library.register_autograd("deep_ep::internode_combine", _internode_combine_backward,
                                setup_context=_internode_combine_setup)

# The low-latency ops mutate their stats arguments, so torch.library.register_autograd refuses
# them; without an autograd kernel torch only warns that they "may lead to silently incorrect
# behavior" and gives their outputs a grad_fn whose backward leaves the inputs' .grad at None.
# They have no backward (decode only): a fallthrough at the Autograd key skips autograd in the
# dispatcher itself (no Python on the call path), so their outputs are plain tensors and a
# backward through them fails at once in torch ("does not require grad") instead of computing
# nothing.
_below_autograd = torch.library.Library("deep_ep", "IMPL")

for _op in ("low_latency_dispatch", "low_latency_combine", "low_latency_combine_alloc", "low_latency_dispatch_send",
            "low_latency_dispatch_recv", "low_latency_combine_send", "low_latency_combine_recv"):
    _below_autograd.impl(_op, torch.library.fallthrough_kernel, "Autograd")
