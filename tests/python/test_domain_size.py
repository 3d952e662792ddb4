"""DEEP_EP_NVL_DOMAIN_SIZE has one parser, the library's (`deep_ep::nvl_domain_size`): the Python
package, the fake kernels and the size hints ask it, so every layer sees one value, and a
malformed value is an error naming the variable everywhere (never a silent default of 8)."""
import re

import pytest
import torch
import torch.distributed as dist
from _harness import env_var

MALFORMED = ["+1", "abc", "0", " 2", "2 ", "9", "2.0", "-1", "08"]
CPU = torch.device("cpu")
BF16 = torch.bfloat16


@pytest.mark.parametrize("value,want", [(None, 8), ("", 8), ("1", 1), ("2", 2), ("8", 8)])
def test_valid_values(ops, deep_ep, monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("DEEP_EP_NVL_DOMAIN_SIZE", raising=False)
    else:
        monkeypatch.setenv("DEEP_EP_NVL_DOMAIN_SIZE", value)
    assert ops.nvl_domain_size() == want
    from deep_ep_rs.buffer import _nvl_domain_size
    from deep_ep_rs._fake import _domain

    assert _nvl_domain_size() == want and _domain() == want


@pytest.mark.parametrize("value", MALFORMED)
def test_malformed_values_raise_naming_the_variable(ops, deep_ep, monkeypatch, value):
    cfg = deep_ep.Buffer.get_dispatch_config(4)
    monkeypatch.setenv("DEEP_EP_NVL_DOMAIN_SIZE", value)
    msg = re.escape(f'DEEP_EP_NVL_DOMAIN_SIZE="{value}" is not a whole number in 1..=8')
    with pytest.raises(RuntimeError, match="deep_ep::nvl_domain_size: " + msg):
        ops.nvl_domain_size()
    with pytest.raises(RuntimeError, match="deep_ep::get_dispatch_layout: " + msg):
        ops.get_dispatch_layout(torch.zeros((2, 1), dtype=torch.int64), 8, 4)
    with pytest.raises(RuntimeError, match="deep_ep::rdma_buffer_size_hint: " + msg):
        cfg.get_rdma_buffer_size_hint(512, 4)
    with pytest.raises(RuntimeError, match="deep_ep::nvl_buffer_size_hint: " + msg):
        cfg.get_nvl_buffer_size_hint(512, 4)
    with pytest.raises(RuntimeError, match="deep_ep::create_buffer: " + msg):
        ops.create_buffer(ops.get_unique_id("cpu", CPU), 0, 1, CPU, 1 << 20, 0, False, "cpu")


def test_hints_size_for_the_domain(deep_ep, monkeypatch):
    cfg = deep_ep.Buffer.get_dispatch_config(4)
    monkeypatch.delenv("DEEP_EP_NVL_DOMAIN_SIZE", raising=False)
    nvl8, rdma8 = cfg.get_nvl_buffer_size_hint(512, 4), cfg.get_rdma_buffer_size_hint(512, 4)
    assert rdma8 == 0  # one domain of 8 holds the 4 ranks
    monkeypatch.setenv("DEEP_EP_NVL_DOMAIN_SIZE", "2")
    nvl2, rdma2 = cfg.get_nvl_buffer_size_hint(512, 4), cfg.get_rdma_buffer_size_hint(512, 4)
    assert rdma2 > 0, "4 ranks in domains of 2 span 2 domains: they need an RDMA area"
    assert nvl2 < nvl8, "the NVLink area holds one domain's 2 peers, not all 4 ranks"
    with pytest.raises(RuntimeError, match="num_ranks must be <= 2 or a multiple of 2"):
        cfg.get_rdma_buffer_size_hint(512, 3)


def _sized_from_hints_worker(rank, world):
    import deep_ep_rs

    h, e = 256, 8
    with env_var("DEEP_EP_NVL_DOMAIN_SIZE", 2):
        cfgs = (deep_ep_rs.Buffer.get_dispatch_config(world), deep_ep_rs.Buffer.get_combine_config(world))
        nvl = max(c.get_nvl_buffer_size_hint(h * 2, world) for c in cfgs)
        rdma = max(c.get_rdma_buffer_size_hint(h * 2, world) for c in cfgs)
        buf = deep_ep_rs.Buffer(dist.group.WORLD, nvl, rdma, device="cpu", explicitly_destroy=True)
        try:
            assert buf.get_num_rdma_ranks() == 2
            g = torch.Generator().manual_seed(rank)
            idx = torch.randint(0, e, (16, 2), generator=g)
            x = torch.randint(-8, 8, (16, h), generator=g).to(BF16)
            ntpr, ntprr, ntpe, ir, _ = buf.get_dispatch_layout(idx, e)
            assert ntprr is not None and ntprr.numel() == 2
            recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr,
                                                      is_token_in_rank=ir, num_tokens_per_expert=ntpe, topk_idx=idx,
                                                      topk_weights=torch.ones(idx.shape))
            out, _, _ = buf.combine(recv_x, handle)
            want = (x.float() * ir.sum(dim=1, keepdim=True).float()).to(BF16)
            assert torch.equal(out, want)
            return nvl, rdma, int(recv_x.shape[0])
        finally:
            buf.destroy()


def test_buffer_sized_from_the_hints_works_in_two_domains(rank_pool):
    """4 CPU ranks as 2 domains of 2: Buffer(num_nvl_bytes, num_rdma_bytes) from the Config hints is
    accepted (the RDMA hint is > 0) and internode dispatch/combine run in it."""
    results = rank_pool(4).run(_sized_from_hints_worker)
    assert all(r[1] > 0 for r in results) and sum(r[2] for r in results) > 0


def test_compile_with_a_malformed_value_raises_instead_of_tracing(ops, monkeypatch):
    def layout(idx):
        return ops.get_dispatch_layout(idx, 8, 4)[1]

    idx = torch.tensor([[0, 5], [-1, 3], [7, -1], [-1, -1]])
    monkeypatch.setenv("DEEP_EP_NVL_DOMAIN_SIZE", "2")
    torch._dynamo.reset()
    assert torch.compile(layout, fullgraph=True, backend="aot_eager")(idx).tolist() == [2, 2]
    for bad in ("+1", "abc"):
        monkeypatch.setenv("DEEP_EP_NVL_DOMAIN_SIZE", bad)
        torch._dynamo.reset()
        with pytest.raises(Exception, match=re.escape(f'DEEP_EP_NVL_DOMAIN_SIZE="{bad}" is not a whole number')):
            torch.compile(layout, fullgraph=True, backend="aot_eager")(idx)
    torch._dynamo.reset()
