"""examples/moe_layer.py on the CPU backend, 1 rank: prefill (normal ops) and decode (low-latency
ops) match the plain-torch reference to bf16 accuracy, torch.compile(fullgraph=True) of each is
bit-identical to eager, and prefill's gradients (x, router, experts) match the reference's."""
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_buffer1

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from moe_layer import MoELayer, make_params, reference  # noqa: E402

H, EL, K, T = 128, 4, 2, 8


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture
def layer(ops):
    nbytes = -(-int(ops.low_latency_rdma_size_hint(T, H, 1, EL)) // 128) * 128
    h = make_buffer1(ops, num_nvl_bytes=1 << 22, num_rdma_bytes=nbytes, low_latency_mode=True)
    yield MoELayer(h, 1, 0, hidden=H, experts_per_rank=EL, topk=K, max_decode_tokens=T, config=[4, 6, 256, 6, 128])
    ops.destroy_buffer(h)


def inputs(n, seed):
    return torch.randn((n, H), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.slow
@pytest.mark.lowlatency
def test_moe_layer_eager_compiled_and_reference(layer):
    import torch._dynamo

    torch._dynamo.reset()
    router, w_all = make_params(1, H, EL)
    with torch.no_grad():
        for decode, n in [(False, 13), (True, T), (True, 5)]:
            x = inputs(n, seed=n)
            want = reference([x], router, w_all, K)[0]
            eager = layer(x, decode=decode)
            assert rel_err(eager, want) < 1e-2 and float(want.abs().sum()) > 0, (decode, n)
            compiled = torch.compile(layer.decode if decode else layer.prefill, fullgraph=True)(x)
            assert torch.equal(compiled, eager), (decode, n)


def test_moe_layer_prefill_gradients(layer):
    router0, w_all0 = make_params(1, H, EL)
    x0, target = inputs(11, seed=1), torch.randn((11, H), generator=torch.Generator().manual_seed(2))
    x = x0.clone().requires_grad_()
    (layer(x).float() * target).sum().backward()
    xr, rr, wr = x0.float().requires_grad_(), router0.clone().requires_grad_(), w_all0.float().requires_grad_()
    (reference([xr], rr, wr, K)[0] * target).sum().backward()
    errs = {"x": rel_err(x.grad, xr.grad), "router": rel_err(layer.router.grad, rr.grad), "w": rel_err(layer.w.grad, wr.grad)}
    assert all(v < 1e-2 for v in errs.values()), errs
