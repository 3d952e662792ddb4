"""GPU twin of tests/python/test_elastic.py: ElasticBuffer (DeepEP V2's API) on a GPU backend at 2
and 4 ranks (one GPU per rank, or all ranks on one GPU with the ipc backend: `_spawn`).

- dispatch/combine against the plain-torch reference in every layout / sync / FP8 / alignment
  combination, synchronous and with V2's event arguments (communication stream, events);
- a MoE training step (torchtitan's wiring and the buffer's own autograd) against fp32 torch;
- CUDA graphs: dispatch (do_cpu_sync=False) + experts + combine captured once per layout and
  replayed with new tokens and new routing, bit-exact against the reference;
- torch.compile(fullgraph=True) (inductor) of the MoE layer without CPU sync equals eager;
- the torchtitan, SGLang and vLLM V2 call sequences under DeepEP's harness defaults.
"""
import sys
from pathlib import Path

import pytest
import torch

import _spawn

sys.path.append(str(Path(__file__).resolve().parents[1] / "python"))
import _elastic_cases  # noqa: E402
import _frameworks_v2  # noqa: E402


def _env(world):
    """The backend for `world` ranks (ipc when they share a GPU)."""
    return {"DEEP_EP_BACKEND": _spawn.gpu_backend(world)}


def _dev(rank):
    return str(_spawn.device(rank))


def _dispatch_combine(rank, world, async_mode):
    return _elastic_cases.dispatch_combine(rank, world, _dev(rank), async_mode=async_mode)


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "events"])
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_match_reference_gpu(world, async_mode):
    out = _spawn.run(_dispatch_combine, world, async_mode, env=_env(world))
    assert all(len(o["ok"]["configs"]) == 16 for o in out), out


def _autograd(rank, world):
    return _elastic_cases.moe_autograd(rank, world, _dev(rank))


@pytest.mark.parametrize("world", [2, 4])
def test_moe_training_step_matches_plain_torch_gpu(world):
    out = _spawn.run(_autograd, world, env=_env(world))
    assert len(out[0]["ok"]) == 8, out


def _graph(rank, world):
    """dispatch (no CPU sync) + experts + combine in one CUDA graph per layout; replays with new
    tokens and routing written into the captured inputs."""
    import torch.distributed as dist

    import deep_ep_rs

    dev = _spawn.device(rank)
    t, k, el = 32, 2, 2
    e = el * world
    h = _elastic_cases.HIDDEN
    buf = deep_ep_rs.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=t, hidden=h, num_topk=k, explicitly_destroy=True)
    x = torch.zeros((t, h), dtype=torch.bfloat16, device=dev)
    idx = torch.full((t, k), -1, dtype=torch.int64, device=dev)
    w = torch.zeros((t, k), dtype=torch.float32, device=dev)
    done = {}
    for expand, alignment in ((False, 1), (True, 1), (True, 128)):
        def fill(step):
            xc, ic, wc = _elastic_cases.make_inputs(rank, t, k, e, seed=100 * step + alignment)
            x.copy_(xc), idx.copy_(ic), w.copy_(wc)
            return xc, ic, wc

        def body():
            recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e, do_cpu_sync=False,
                                                               do_expand=expand, expert_alignment=alignment)
            y = _elastic_cases._expert_rows({"expand": expand}, recv_x, recv_idx, recv_w, handle, rank, el)
            return buf.combine(y, handle)[0]

        fill(0)
        body()  # eager warm-up (collective)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body()
        for step in range(1, 4):
            xc, ic, wc = fill(step)
            graph.replay()
            torch.cuda.synchronize()
            want = _elastic_cases.expected_combine(xc, ic, wc, e, world, None)
            assert torch.equal(out.cpu(), want), f"expand={expand} alignment={alignment} replay {step}"
        del graph
        done[f"expand={expand},alignment={alignment}"] = True
    buf.destroy()
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_graph_of_dispatch_combine_without_cpu_sync(world):
    out = _spawn.run(_graph, world, env=_env(world))
    assert all(len(o["ok"]) == 3 for o in out), out


def _compile(rank, world):
    return _elastic_cases.moe_compile(rank, world, _dev(rank), backend="inductor", exact=False)


def test_moe_layer_compiles_fullgraph_with_inductor():
    out = _spawn.run(_compile, 2, env=_env(2))
    assert all(o["ok"] == {"expand=False": True, "expand=True": True} for o in out), out


def _framework(rank, world, name):
    return _frameworks_v2.WORKERS[name](rank, world, _dev(rank), "cuda")


@pytest.mark.parametrize("name", sorted(_frameworks_v2.WORKERS))
def test_framework_v2_call_path_gpu(name):
    out = _spawn.run(_framework, 2, name, env=_env(2))
    assert all(o["ok"] for o in out), out
