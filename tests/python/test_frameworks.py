"""Drop-in for code written against DeepEP V1 (CPU backend): the call sequences of Megatron-Core,
SGLang and vLLM (tests/python/_frameworks.py) on 2 and 4 ranks under DeepEP's harness defaults
(bf16 default dtype, default device `meta`), complete `deep_ep` aliasing in a clean interpreter,
error texts that name devices and dtypes as torch does, and DeepEP's config tables answering for
every rank count. The GPU twin: tests/gpu/test_frameworks_gpu.py (one rank on one GPU)."""
import subprocess
import sys
import textwrap

import pytest
import torch

import _frameworks


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(_frameworks.WORKERS))
def test_framework_call_path_under_deepep_defaults(rank_pool, world, name):
    results = rank_pool(world).run(_framework_entry, name)
    assert len(results) == world and all(results), results


def _framework_entry(rank, world, name):
    # 'meta' as the default device: any tensor the library makes without naming a device lands
    # there and fails loudly (on GPUs the twin uses 'cuda').
    return _frameworks.WORKERS[name](rank, world, "cpu", "meta")


ALIASING = textwrap.dedent("""
    import sys, torch
    import deep_ep_rs
    deep_ep_rs.install_as_deep_ep()
    import deep_ep
    from deep_ep import Buffer, Config, EventOverlap, topk_idx_t
    from deep_ep import ElasticBuffer, EPHandle, get_physical_domain_size, get_logical_domain_size  # DeepEP V2
    from deep_ep.utils import EventHandle, EventOverlap as UtilsEventOverlap, check_nvlink_connections
    import deep_ep.buffer
    import deep_ep.utils as du
    import deep_ep.diagnose                      # a submodule not imported before install
    from deep_ep_cpp import Config as CppConfig, EventHandle as CppEventHandle
    assert deep_ep is deep_ep_rs
    assert Buffer is deep_ep_rs.Buffer and Config is deep_ep_rs.Config and topk_idx_t is torch.int64
    assert EventOverlap is UtilsEventOverlap is deep_ep_rs.utils.EventOverlap is deep_ep_rs.EventOverlap
    assert EventHandle is deep_ep_rs.utils.EventHandle and CppEventHandle is EventHandle and CppConfig is Config
    assert deep_ep.buffer is deep_ep_rs.buffer and du is deep_ep_rs.utils
    assert deep_ep.diagnose is sys.modules["deep_ep_rs.diagnose"]
    assert deep_ep.buffer.Buffer is Buffer
    import deep_ep.elastic
    assert ElasticBuffer is deep_ep_rs.ElasticBuffer is deep_ep.elastic.ElasticBuffer and EPHandle is deep_ep_rs.EPHandle
    assert get_physical_domain_size is deep_ep_rs.get_physical_domain_size and get_logical_domain_size is deep_ep_rs.elastic.get_logical_domain_size
    for name in ("deep_ep.utils", "deep_ep.buffer", "deep_ep.diagnose", "deep_ep.elastic"):
        assert sys.modules[name] is sys.modules["deep_ep_rs" + name[len("deep_ep"):]], name
    assert isinstance(deep_ep_rs.Buffer.capture(), EventOverlap)
    assert isinstance(EventOverlap(EventHandle()), deep_ep_rs.utils.EventOverlap)
    deep_ep_rs.install_as_deep_ep()              # idempotent
    print("aliasing ok")
""")


def test_install_as_deep_ep_aliases_every_submodule():
    """In a clean interpreter (no earlier import of deep_ep.*): one module object per name."""
    p = subprocess.run([sys.executable, "-c", ALIASING], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and "aliasing ok" in p.stdout, p.stderr


@pytest.mark.parametrize("num_ranks", list(range(1, 161)) + [200, 256])
def test_default_configs_answer_for_every_rank_count(deep_ep, num_ranks):
    d, c = deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)
    assert d.num_sms == c.num_sms == deep_ep.Buffer.num_sms
    if num_ranks <= 8 or num_ranks % 8 == 0:
        assert d.get_nvl_buffer_size_hint(7168 * 2, num_ranks) > 0 and c.get_nvl_buffer_size_hint(7168 * 2, num_ranks) > 0
    else:  # as DeepEP: more than one NVLink domain of 8 needs whole domains
        with pytest.raises(RuntimeError, match="num_ranks must be <= 8 or a multiple of 8"):
            d.get_nvl_buffer_size_hint(7168 * 2, num_ranks)


@pytest.mark.parametrize("bad", [0, -1])
def test_default_configs_reject_nonsense_rank_counts(deep_ep, bad):
    with pytest.raises(AssertionError, match="EP ranks"):
        deep_ep.Buffer.get_dispatch_config(bad)


def test_errors_name_devices_and_dtypes_as_torch_does(ops):
    uid = ops.get_unique_id("cpu", torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"got torch\.float32 of shape \[128\] on cpu"):
        ops.create_buffer(uid.float(), 0, 1, torch.device("cpu"), 1 << 20, 0, False, "cpu")
    with pytest.raises(RuntimeError, match=r"device must be cpu or cuda, got meta"):
        ops.create_buffer(uid, 0, 1, torch.device("meta"), 1 << 20, 0, False, "cpu")
    with pytest.raises(RuntimeError, match=r"got torch\.uint8 of shape \[128\] on meta"):
        ops.create_buffer(uid.to("meta"), 0, 1, torch.device("cpu"), 1 << 20, 0, False, "cpu")


def test_buffer_ignores_torch_defaults_in_one_rank(deep_ep):
    """Buffer creation, layout, hints and the LL size hint with bf16 / 'meta' defaults (one rank,
    in-process; the multi-rank paths are the framework tests above)."""
    import torch.distributed as dist

    from _harness import free_port

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with _frameworks.deepep_defaults("meta"):
            buf = deep_ep.Buffer(dist.group.WORLD, 1 << 22, 0, explicitly_destroy=True)
            assert buf.device.type == "cpu"
            idx = torch.tensor([[0, 1], [1, -1]], dtype=torch.int64, device="cpu")
            ntpr, _, ntpe, in_rank, ev = buf.get_dispatch_layout(idx, 2)
            assert ntpr.device.type == "cpu" and ntpr.dtype == torch.int32 and in_rank.dtype == torch.bool
            assert buf.wait_stats().device.type == "cpu"
            assert deep_ep.Buffer.get_low_latency_rdma_size_hint(8, 256, 1, 2) > 0
            report = buf.memory_report(hidden=256)
            assert report["meets_size_hints"] in (True, False)
            buf.destroy()
    finally:
        if started:
            dist.destroy_process_group()
