"""`Buffer.get_local_buffer_tensor` / `deep_ep::get_local_buffer_tensor` (DeepEP V1's raw view of
this rank's part of the buffer) on the CPU backend: shapes, offsets, dtypes, `size`, aliasing of
the shared mapping, the Buffer kept alive by its views, the fake kernel, opcheck, and what a reset
through the view means for low-latency calls (between steps: nothing; between a dispatch that
carried top-k weights and its combine: an error, not zeros). vLLM's reset sequence at 2 and 4
ranks: tests/python/test_frameworks.py (`vllm_clean_buffers`)."""
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from conftest import make_buffer1

NVL, RDMA = 1 << 20, 3 << 14  # RDMA: not a multiple of the page size (the view has the exact size)


@pytest.fixture
def h(ops):
    handle = make_buffer1(ops, num_nvl_bytes=NVL, num_rdma_bytes=RDMA, low_latency_mode=True)
    yield handle
    ops.destroy_buffer(handle)


DTYPES = [torch.int8, torch.uint8, torch.bfloat16, torch.float16, torch.int32, torch.float32, torch.int64, torch.float64,
          torch.float8_e4m3fn, torch.bool, torch.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rdma", [False, True])
def test_shape_dtype_device_and_offsets(ops, h, dtype, rdma):
    size = RDMA if rdma else NVL
    item = torch.empty((), dtype=dtype).element_size()
    base = ops.get_local_buffer_tensor(h, torch.uint8, 0, rdma)
    for offset in (0, item, 16 * item, size - item, size):
        t = ops.get_local_buffer_tensor(h, dtype, offset, rdma)
        assert t.dtype == dtype and t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous()
        assert t.numel() == (size - offset) // item, (offset, t.numel())
        if t.numel():  # torch reports address 0 for an empty tensor
            assert t.data_ptr() == base.data_ptr() + offset
    # defaults: offset 0, the NVLink part
    assert ops.get_local_buffer_tensor(h, dtype).numel() == NVL // item


def test_parts_are_the_ranks_own_memory_and_views_alias_it(ops, h):
    nvl, ll = ops.get_local_buffer_tensor(h, torch.uint8), ops.get_local_buffer_tensor(h, torch.uint8, 0, True)
    a, b = nvl.data_ptr(), ll.data_ptr()
    assert a % 4096 == 0 and b % 4096 == 0, "both parts start page-aligned"
    assert b >= a + NVL or a >= b + RDMA, "the two parts do not overlap"
    words = ops.get_local_buffer_tensor(h, torch.int32, 64, True)
    words[:4] = torch.tensor([1, -2, 3, 0x7FFFFFFF], dtype=torch.int32)
    again = ops.get_local_buffer_tensor(h, torch.int32, 64, True)
    assert again[:4].tolist() == [1, -2, 3, 0x7FFFFFFF], "a second view sees the first view's writes"
    assert ll[64:68].view(torch.int32).item() == 1
    again.zero_()
    assert not bool(words.any())


def test_buffer_method_size_offset_and_lifetime(deep_ep):
    from _harness import free_port

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        buf = deep_ep.Buffer(dist.group.WORLD, NVL, RDMA, low_latency_mode=True)
        t = buf.get_local_buffer_tensor(torch.float32, size=torch.Size([8, 16]), offset=128, use_rdma_buffer=True)
        assert t.shape == (8, 16) and t.dtype == torch.float32 and t.is_contiguous()
        raw = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        assert t.data_ptr() == raw.data_ptr() + 128 and raw.numel() == RDMA
        assert buf.get_local_buffer_tensor(torch.bfloat16, size=(3,)).shape == (3,), "any sequence of ints as size"
        assert buf.get_local_buffer_tensor(torch.bfloat16, size=NVL // 2).numel() == NVL // 2, "an int as size, the whole part"
        with pytest.raises(AssertionError, match=r"size \(8193,\) needs 8193 elements, the part holds 8192"):
            buf.get_local_buffer_tensor(torch.float32, size=torch.Size([8193]), offset=RDMA - 4 * 8192, use_rdma_buffer=True)
        # The view keeps the Buffer (and so its memory) alive: dropping every other reference
        # does not release the buffer under it.
        ref = weakref.ref(buf)
        del buf, raw
        gc.collect()
        assert ref() is not None, "a live view keeps its Buffer"
        t.fill_(2.5)
        assert float(t.sum()) == 2.5 * 128
        del t
        gc.collect()
        assert ref() is None, "the Buffer goes with its last view"
    finally:
        if started:
            dist.destroy_process_group()


def test_normal_mode_buffer_without_rdma_bytes_has_an_empty_rdma_part(ops):
    handle = make_buffer1(ops, num_nvl_bytes=NVL)
    try:
        assert ops.get_local_buffer_tensor(handle, torch.int8, 0, True).shape == (0,)
        assert ops.get_local_buffer_tensor(handle, torch.int8, 0, False).shape == (NVL,)
    finally:
        ops.destroy_buffer(handle)


@pytest.mark.parametrize("args", [(torch.int8, 0, True), (torch.float32, 256, False), (torch.bfloat16, RDMA, True)], ids=str)
def test_fake_kernel_matches_the_real_one(ops, h, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = ops.get_local_buffer_tensor(h, *args)
    with FakeTensorMode():
        fake = ops.get_local_buffer_tensor(h, *args)
    assert (fake.shape, fake.dtype, fake.device, fake.stride()) == (real.shape, real.dtype, real.device, real.stride())


def test_opcheck(ops, h):
    for args in ((h, torch.int8, 0, True), (h, torch.float32, 64, False)):
        result = torch.library.opcheck(ops.get_local_buffer_tensor.default, args, test_utils=("test_schema", "test_faketensor"))
        assert result == {"test_schema": "SUCCESS", "test_faketensor": "SUCCESS"}, result


# ---------------------------------------------------------------------------------------------
# resets through the view and the low-latency protocol (2 ranks)


def _reset_worker(rank, world, where):
    import deep_ep_rs

    t_max, e, n, hidden = 8, 4 * world, 5, 256
    rdma = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t_max, hidden, world, e)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-4, 5, (n, hidden), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(n)])
    w = torch.full((n, 2), 0.5)
    want = x  # two experts, weight 0.5 each, identity experts

    def reset():
        buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()
        dist.barrier()

    out = {}
    try:
        for carry in (False, True):
            for step in range(3):
                recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t_max, e, use_fp8=False, topk_weights=w if carry else None)
                if where == "between dispatch and combine":
                    reset()
                try:
                    combined, _, _ = buf.low_latency_combine(recv, idx, w, handle)
                except RuntimeError as ex:
                    out[(carry, step)] = str(ex)
                    continue
                out[(carry, step)] = bool(torch.equal(combined, want))
                if where == "between steps":
                    reset()
    finally:
        buf.destroy()
    return out


def test_reset_between_steps_changes_nothing(rank_pool):
    for res in rank_pool(2).run(_reset_worker, "between steps"):
        assert all(v is True for v in res.values()), res


def test_reset_between_a_weighted_dispatch_and_its_combine_raises(rank_pool):
    """The combine of a dispatch that carried top-k weights reads the dispatch's messages back
    (partial sums); a reset in between erased them. Raise on every rank instead of returning
    zeros; combines without carried weights read nothing back and stay exact."""
    for res in rank_pool(2).run(_reset_worker, "between dispatch and combine"):
        for (carry, step), v in res.items():
            if carry:
                assert isinstance(v, str) and "messages are no longer in the buffer" in v, v
            else:
                assert v is True, (step, v)
