"""GPU smoke: the library loads on the GPU machine, its ops are registered, our layout kernel
runs on every GPU (eagerly and inside a CUDA graph) and matches the CPU implementation bit for
bit, and NCCL is found at the version the library was built for."""
import json
import os

import pytest
import torch

import deep_ep_rs

ops = torch.ops.deep_ep
EXPECTED_OPS = ["get_unique_id", "create_buffer", "destroy_buffer", "bind_buffer_slot", "buffer_info", "get_dispatch_layout", "dispatch",
                "cached_dispatch", "combine", "low_latency_dispatch", "low_latency_dispatch_send", "low_latency_dispatch_recv",
                "low_latency_combine", "low_latency_combine_send", "low_latency_combine_recv", "clean_low_latency_buffer",
                "get_next_low_latency_combine_buffer", "nvl_buffer_size_hint", "rdma_buffer_size_hint", "low_latency_rdma_size_hint",
                "low_latency_update_mask_buffer", "low_latency_query_mask_buffer", "low_latency_clean_mask_buffer",
                "low_latency_set_shrink", "wait_stats", "get_local_buffer_tensor"]


def test_ops_registered():
    for name in EXPECTED_OPS:
        assert hasattr(ops, name), name
        assert getattr(ops, name).default._schema.name == f"deep_ep::{name}"


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(0, 8, 256, 4), (1, 1, 8, 2), (4096, 8, 256, 4), (777, 9, 288, 8), (3000, 6, 128, 16)])
def test_layout_kernel_matches_cpu_on_every_gpu(shape, idx_dtype):
    n, k, e, r = shape
    g = torch.Generator().manual_seed(n * 31 + k)
    idx = torch.randint(-1, e, (n, k), generator=g).to(idx_dtype)
    want = ops.get_dispatch_layout(idx, e, r)
    for d in range(torch.cuda.device_count()):
        got = ops.get_dispatch_layout(idx.to(f"cuda:{d}"), e, r)
        torch.cuda.synchronize(d)
        for a, b in zip(got, want):
            assert a.device.index == d
            assert torch.equal(a.cpu(), b), (shape, d)


@pytest.mark.parametrize("domain", [1, 2, 4])
def test_layout_kernel_with_emulated_nodes_matches_cpu(domain, monkeypatch):
    """DEEP_EP_NVL_DOMAIN_SIZE below 8: the per-node counts (num_tokens_per_rdma_rank [R / D])
    come from the CUDA kernel too, equal to the CPU backend's."""
    monkeypatch.setenv("DEEP_EP_NVL_DOMAIN_SIZE", str(domain))
    n, k, e, r = 3000, 8, 64, 8
    idx = torch.randint(-1, e, (n, k), generator=torch.Generator().manual_seed(domain)).to(torch.int64)
    want = ops.get_dispatch_layout(idx, e, r)
    assert want[1] is not None and want[1].shape == (r // domain,)
    got = ops.get_dispatch_layout(idx.cuda(), e, r)
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b), domain


def test_layout_kernel_in_cuda_graph():
    idx = torch.randint(-1, 256, (4096, 8), device="cuda")
    out = ops.get_dispatch_layout(idx, 256, 8)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.get_dispatch_layout(idx, 256, 8)
    for _ in range(3):
        idx.copy_(torch.randint(-1, 256, (4096, 8), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = ops.get_dispatch_layout(idx.cpu(), 256, 8)
        for a, b in zip(captured, want):
            assert torch.equal(a.cpu(), b)
    del out


def test_nccl_backend_single_rank_round_trip():
    """A one-rank nccl buffer: dispatch returns the tokens, combine sums them back."""
    uid = ops.get_unique_id("nccl", torch.device("cuda", 0))
    assert uid.dtype == torch.uint8 and uid.numel() == 128 and int(uid.sum()) != 0
    h = ops.create_buffer(uid, 0, 1, torch.device("cuda", 0), 1 << 20, 0, False, "nccl")
    info = ops.buffer_info(h)
    assert info[:3] == [0, 1, 0] and info[6] == 1
    x = torch.randn(4, 256, device="cuda").bfloat16()
    idx = torch.tensor([[0], [-1], [3], [7]], dtype=torch.int64, device="cuda")
    w = torch.ones(4, 1, device="cuda")
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 8, 1)
    cfg = [20, 6, 256, 6, 128]
    d = ops.dispatch(h, x, None, idx, w, ntpr, in_rank, ntpe, 1, 0, cfg)
    recv_x, recv_idx, recv_src = d[0], d[2], d[8]
    assert recv_x.shape == (3, 256) and torch.equal(recv_x, x[[0, 2, 3]])
    assert recv_src.tolist() == [0, 2, 3] and recv_idx.flatten().tolist() == [0, 3, 7]
    comb, _ = ops.combine(h, recv_x, None, None, None, d[5], d[6], d[7], d[8], in_rank, d[9], cfg)
    assert torch.equal(comb[[0, 2, 3]], x[[0, 2, 3]]) and int(comb[1].abs().sum()) == 0
    ops.destroy_buffer(h)
    out = os.environ.get("DEEP_EP_SMOKE_JSON")
    if out:
        with open(out, "w") as f:
            json.dump({"gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "library": deep_ep_rs.library_path()}, f)
