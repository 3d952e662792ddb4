"""Autograd formulas of the normal-mode ops (torch.library.register_autograd).

dispatch copies each token row to the ranks of its experts, and combine sums the rows back, so
each is the other's adjoint:

- ``deep_ep::dispatch`` is differentiable w.r.t. ``x`` (BF16 only: an FP8 ``x`` with scales is
  not differentiable and asking for its gradient raises) and ``topk_weights``. The gradient of
  ``recv_x`` goes back through ``combine`` with the handle this dispatch returned (an unweighted
  fp32 sum over ranks, rounded to bf16 like ``x``). The gradient of ``recv_topk_weights`` goes back
  through the same combine, masked to the entries dispatch copied (``recv_topk_idx >= 0``: entries
  of experts on other ranks are zeroed by dispatch and carry no gradient). Worst-case padding rows
  (``recv_src_idx == -1``) carry no gradient; they are zeroed before the combine.
- ``deep_ep::combine`` is differentiable w.r.t. ``x``, ``topk_weights``, ``bias_0`` and ``bias_1``.
  The gradient of ``combined_x`` goes back through ``cached_dispatch`` with the cached handle (a
  copy back to every contributing row); the gradient of ``combined_topk_weights`` ([N, K] f32) is
  sent through the same ``cached_dispatch`` bit-exactly, viewed as a bf16 row tensor; each bias
  gets ``grad_combined_x`` as is. Rows without a source (worst-case padding) get zero gradient.

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


def _zeros_like_rows(t, n, dtype=None):
    return t.new_zeros((n,) + tuple(t.shape[1:]), dtype=dtype or t.dtype)


# ---------------------------------------------------------------------------------------------
# dispatch


def _dispatch_setup(ctx, inputs, output):
    (handle, x, x_scales, topk_idx, topk_weights, _ntpr, is_token_in_rank, _ntpe, _align, _worst, config) = inputs
    if x_scales is not None and isinstance(x, torch.Tensor) and x.requires_grad:
        raise RuntimeError("deep_ep::dispatch: an FP8 x (with x_scales) is not differentiable; "
                           "detach it or dispatch BF16 to get gradients")
    recv_x, _, recv_idx, _, _, rpm, cpm, rcpm, src_idx, send_head = output
    ctx.handle, ctx.config = handle, list(config)
    ctx.has_weights = topk_weights is not None
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head,
                          recv_idx if topk_idx is not None else None)


def _dispatch_backward(ctx, grad_recv_x, grad_recv_scales, grad_recv_idx, grad_recv_w, grad_per_expert,
                       *grad_handle):
    rpm, cpm, rcpm, src_idx, in_rank, send_head, recv_idx = ctx.saved_tensors
    rows = src_idx.shape[0]
    real = (src_idx >= 0).unsqueeze(1)  # worst-case padding rows carry no gradient
    need_x, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[4]
    if grad_recv_x is None:
        raise RuntimeError("deep_ep::dispatch backward: no gradient for recv_x (internal error)")
    gx = torch.where(real, grad_recv_x, torch.zeros_like(grad_recv_x)).to(torch.bfloat16).contiguous()
    gw = None
    if ctx.has_weights and need_w:
        if grad_recv_w is None:
            gw = torch.zeros((rows, recv_idx.shape[1]), dtype=torch.float32, device=gx.device)
        else:
            gw = torch.where(recv_idx >= 0, grad_recv_w.float(), torch.zeros_like(grad_recv_w, dtype=torch.float32))
            gw = gw.contiguous()
    cx, cw = ops.combine(ctx.handle, gx, gw, None, None, rpm, cpm, rcpm, src_idx, in_rank, send_head, ctx.config)
    grad_x = cx.to(ctx.x_dtype) if need_x else None
    grad_w = cw if gw is not None else None
    return None, grad_x, None, None, grad_w, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# combine


def _combine_setup(ctx, inputs, output):
    (handle, x, topk_weights, bias_0, bias_1, rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head, config) = inputs
    ctx.handle, ctx.config = handle, list(config)
    ctx.x_dtype = x.dtype
    ctx.w_dtype = topk_weights.dtype if topk_weights is not None else None
    ctx.bias_dtypes = (bias_0.dtype if bias_0 is not None else None, bias_1.dtype if bias_1 is not None else None)
    ctx.save_for_backward(rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head)


def cached_dispatch_rows_f32(handle, t, rpm, cpm, rcpm, src_idx, in_rank, send_head, config):
    """cached_dispatch of an f32 [N, K] tensor, bit-exact: the f32 bits travel as bf16 columns."""
    n, k = t.shape
    cols = 2 * k
    padded = -(-cols // _ROW_ALIGN) * _ROW_ALIGN
    bits = t.float().contiguous().view(torch.bfloat16)  # [N, 2K]
    if padded != cols:
        bits = torch.cat([bits, bits.new_zeros((n, padded - cols))], dim=1)
    recv, _ = ops.cached_dispatch(handle, bits.contiguous(), None, rpm, cpm, rcpm, src_idx, in_rank, send_head, config)
    return recv[:, :cols].contiguous().view(torch.float32)


def _combine_backward(ctx, grad_cx, grad_cw):
    rpm, cpm, rcpm, src_idx, in_rank, send_head = ctx.saved_tensors
    real = (src_idx >= 0).unsqueeze(1)
    need = ctx.needs_input_grad
    grad_x = grad_w = None
    if need[1]:
        recv, _ = ops.cached_dispatch(ctx.handle, grad_cx.to(torch.bfloat16).contiguous(), None, rpm, cpm, rcpm, src_idx,
                                      in_rank, send_head, ctx.config)
        grad_x = torch.where(real, recv, torch.zeros_like(recv)).to(ctx.x_dtype)
    if need[2] and ctx.w_dtype is not None:
        if grad_cw is None or grad_cw.numel() == 0:
            grad_w = None
        else:
            recv_w = cached_dispatch_rows_f32(ctx.handle, grad_cw, rpm, cpm, rcpm, src_idx, in_rank, send_head, ctx.config)
            grad_w = torch.where(real, recv_w, torch.zeros_like(recv_w)).to(ctx.w_dtype)
    gb0 = grad_cx.to(ctx.bias_dtypes[0]) if need[3] and ctx.bias_dtypes[0] is not None else None
    gb1 = grad_cx.to(ctx.bias_dtypes[1]) if need[4] and ctx.bias_dtypes[1] is not None else None
    return None, grad_x, grad_w, gb0, gb1, None, None, None, None, None, None, None


torch.library.register_autograd("deep_ep::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("deep_ep::combine", _combine_backward, setup_context=_combine_setup)

# The low-latency ops mutate their stats arguments, so torch.library.register_autograd refuses
# them; without an autograd kernel torch only warns that they "may lead to silently incorrect
# behavior" and gives their outputs a grad_fn whose backward leaves the inputs' .grad at None.
# They have no backward (decode only): a fallthrough at the Autograd key skips autograd in the
# dispatcher itself (no Python on the call path), so their outputs are plain tensors and a
# backward through them fails at once in torch ("does not require grad") instead of computing
# nothing.
_below_autograd = torch.library.Library("deep_ep", "IMPL")

for _op in ("low_latency_dispatch", "low_latency_combine", "low_latency_dispatch_send", "low_latency_dispatch_recv",
            "low_latency_combine_send", "low_latency_combine_recv"):
    _below_autograd.impl(_op, torch.library.fallthrough_kernel, "Autograd")
