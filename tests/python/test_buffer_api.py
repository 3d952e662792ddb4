"""deep_ep_rs's DeepEP-V1 Python surface on a CPU buffer: size hints against DeepEP's formulas and
worked examples (DEEPEP_BEHAVIOUR.md §2), Config, the default config tables, Buffer attributes and
lifecycle, install_as_deep_ep, and DeepEP's event idioms on CPU buffers.

Runs in-process on a 1-rank gloo group.
"""
import sys

import pytest
import torch



@pytest.fixture
def buf(deep_ep, group):
    b = deep_ep.Buffer(group, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    yield b
    if b.is_available():
        b.destroy()


# ---------------------------------------------------------------------------------------------
# size hints


@pytest.mark.parametrize("t,hidden,experts,want", [(128, 7168, 288, 2_146_961_792), (128, 7168, 256, 1_908_410_496),
                                                   (16, 5120, 256, 170_395_776)])
def test_low_latency_rdma_size_hint_worked_examples(deep_ep, t, hidden, experts, want):
    for num_ranks in (8, 16, 32):  # independent of the rank count
        assert deep_ep.Buffer.get_low_latency_rdma_size_hint(t, hidden, num_ranks, experts) == want


def _ll_hint_formula(t, hidden, experts):
    s = hidden // 128
    msg = 16 + max(hidden * 2, hidden + s * 4)
    slot = s * 4 + hidden * 2
    send = max(t * msg, experts * t * slot)
    recv = max(experts * t * msg, experts * t * slot)
    signal = -(-(experts * 4) // 128) * 128
    total = 2 * signal + 2 * send + 2 * recv
    return (total + 128) // 128 * 128


@pytest.mark.parametrize("t,hidden,experts", [(1, 128, 1), (8, 512, 16), (64, 2048, 64), (100, 3072, 48)])
def test_low_latency_rdma_size_hint_formula(deep_ep, t, hidden, experts):
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(t, hidden, 4, experts) == _ll_hint_formula(t, hidden, experts)


def _nvl_hint(num_sms, nvl_recv, hidden_bytes, num_ranks, source_meta=False):
    c, rn, rr, t = num_sms // 2, min(num_ranks, 8), max(num_ranks // 8, 1), nvl_recv
    b = (c * rn * (2 * rr + 3) * 4 + c * rn * t * hidden_bytes + (c * rn * t * 8 if source_meta else 0) + c * rn * t * 128 * 8
         + c * rn * t * 128 * 4 + c * rn * t * 128 * 4)
    return -(-b // 128) * 128


@pytest.mark.parametrize("num_sms,want_deepep", [(20, 335_709_824), (24, 402_851_712)])
def test_nvl_buffer_size_hint(deep_ep, num_sms, want_deepep):
    """DeepEP's worked example includes the SourceMeta term (NVSHMEM builds); this library documents
    (src/config.rs) the NVSHMEM-less formula, i.e. DeepEP's minus C*R*T*8 bytes: smaller, so buffers
    sized for DeepEP are large enough here."""
    cfg = deep_ep.Config(num_sms, 6, 256, 6, 128)
    got = cfg.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert _nvl_hint(num_sms, 256, 7168 * 2, 8, source_meta=True) == want_deepep  # the formula reproduces DeepEP's number
    assert got == _nvl_hint(num_sms, 256, 7168 * 2, 8) == want_deepep - (num_sms // 2) * 8 * 256 * 8
    for r in (1, 2, 3, 4, 8):
        assert cfg.get_nvl_buffer_size_hint(4096, r) == _nvl_hint(num_sms, 256, 4096, r)


def test_rdma_buffer_size_hint(deep_ep):
    cfg = deep_ep.Config(24, 8, 288, 20, 128)
    assert cfg.num_max_rdma_chunked_recv_tokens == 140  # rounded up to a multiple of the send chunk, as DeepEP
    for r in (1, 2, 4, 8):
        assert cfg.get_rdma_buffer_size_hint(7168 * 2, r) == 0
    c, rr, t, hb = 12, 2, 140, 7168 * 2
    b = (c * rr * (8 * 2 + 2) * 2 * 4 + c * rr * t * hb * 2 + c * rr * t * 8 * 2 + c * rr * t * 128 * 8 * 2 + c * rr * t * 128 * 4 * 2
         + c * rr * t * 128 * 4 * 2 + c * rr * t * 16 * 2)
    assert cfg.get_rdma_buffer_size_hint(hb, 16) == -(-b // 128) * 128


# ---------------------------------------------------------------------------------------------
# Config and the default tables


def test_config_fields_and_list(deep_ep):
    cfg = deep_ep.Config(24, 8, 256, 6, 128)
    assert cfg.to_list() == [24, 8, 256, 6, 132]
    assert (cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens) == (24, 8, 256)
    with pytest.raises(RuntimeError, match="num_max_nvl_chunked_send_tokens"):
        deep_ep.Config(24, 256, 256)


DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128), 32: (32, 288, 8, 128),
            160: (28, 720, 12, 128)}
COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128), 32: (1, 288, 8, 128),
           160: (2, 720, 8, 128)}


@pytest.mark.parametrize("num_ranks", sorted(DISPATCH))
def test_default_configs_are_deepep_tables(deep_ep, num_ranks):
    old = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(24)
        d, c = deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)
        rd = lambda recv, send: -(-recv // send) * send  # noqa: E731
        want_d, want_c = DISPATCH[num_ranks], COMBINE[num_ranks]
        assert d.to_list() == [24, want_d[0], want_d[1], want_d[2], rd(want_d[3], want_d[2])]
        assert c.to_list() == [24, want_c[0], want_c[1], want_c[2], rd(want_c[3], want_c[2])]
    finally:
        deep_ep.Buffer.num_sms = old


# ---------------------------------------------------------------------------------------------
# Buffer


def test_buffer_attributes_and_lifecycle(deep_ep, ops, group):
    b = deep_ep.Buffer(group, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    assert (b.rank, b.group_size, b.num_nvl_bytes, b.num_rdma_bytes, b.low_latency_mode) == (0, 1, 1 << 22, 0, False)
    assert b.is_available() and b.device == torch.device("cpu")
    assert b.runtime == b.handle and b.group is group  # DeepEP: runtime is its C++ object; here the op handle
    info = ops.buffer_info(b.handle)
    assert info == [0, 1, -1, 1 << 22, 0, 0, 0, 0]  # the last: hooks run apart (a CPU buffer)
    h = b.handle
    b.destroy()
    assert not b.is_available()
    with pytest.raises(RuntimeError, match="destroyed"):
        b.handle
    with pytest.raises(RuntimeError, match=rf"buffer handle {h} was destroyed"):
        ops.buffer_info(h)
    b.destroy()  # idempotent
    b2 = deep_ep.Buffer(group, 1 << 22, 0, device="cpu")
    with pytest.raises(AssertionError, match="explicitly_destroy"):
        b2.destroy()
    h2 = b2.handle
    del b2  # released by the destructor when explicitly_destroy=False
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match=rf"buffer handle {h2} was destroyed"):
        ops.buffer_info(h2)


@pytest.mark.parametrize("backend", ["nvshmem", "ipc"])
def test_gpu_only_backend_on_cpu_is_a_clear_error(deep_ep, group, backend):
    """backend="nvshmem" or "ipc" needs a CUDA device; a CPU buffer (or a machine without GPU) says so."""
    with pytest.raises(RuntimeError, match=rf"^deep_ep::get_unique_id: backend '{backend}' needs a CUDA device; CPU buffers use the cpu backend"):
        deep_ep.Buffer(group, 1 << 22, 0, device="cpu", backend=backend)
    import json

    assert {"nvshmem", "ipc"} <= set(json.loads(torch.ops.deep_ep.build_info())["backends"])


def test_buffer_requires_a_group(deep_ep):
    with pytest.raises(ValueError, match="group"):
        deep_ep.Buffer(None, 1 << 20)


def test_install_as_deep_ep(deep_ep):
    saved = sys.modules.pop("deep_ep", None)
    try:
        deep_ep.install_as_deep_ep()
        import deep_ep as de

        assert de is deep_ep and de.Buffer is deep_ep.Buffer and de.topk_idx_t == torch.int64
    finally:
        sys.modules.pop("deep_ep", None)
        if saved is not None:
            sys.modules["deep_ep"] = saved


def _dispatch_async(deep_ep, buf, **kw):
    x = torch.randn((5, 64)).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [0, -1], [1, 0]])
    ntpr, _, ntpe, in_rank, ev = buf.get_dispatch_layout(idx, 2, **kw)
    out = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
                       topk_weights=torch.ones((5, 2)), **kw)
    return x, in_rank, ev, out


def test_async_finish_on_cpu_returns_completed_results(deep_ep, buf):
    """CPU buffers finish every op before returning: with async_finish the results are ready and the
    event is empty (no CUDA event exists on a CPU machine)."""
    x, in_rank, ev, out = _dispatch_async(deep_ep, buf, async_finish=True)
    recv_x, _, _, lst, handle, event = out
    assert torch.equal(recv_x, x[in_rank[:, 0]])
    assert event.event is None and ev.event is None
    with event:  # DeepEP's `with event:` idiom works
        pass
    combined, _, cev = buf.combine(recv_x, handle, async_finish=True, previous_event=event, allocate_on_comm_stream=True)
    assert torch.equal(combined, torch.where(in_rank, x, torch.zeros_like(x)))


def test_async_finish_event_wait_on_cpu(deep_ep, buf):
    _, _, ev, out = _dispatch_async(deep_ep, buf, async_finish=True)
    ev.current_stream_wait()
    out[-1].current_stream_wait()


def test_capture_on_cpu_only_machine(deep_ep, buf):
    if torch.cuda.is_available():
        pytest.skip("only meaningful without CUDA")
    ev = deep_ep.Buffer.capture()
    _dispatch_async(deep_ep, buf, previous_event=ev, async_finish=True)
