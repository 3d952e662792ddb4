"""The call sequences real frameworks make into DeepEP V1, written in our own code against
`deep_ep` (= deep_ep_rs after `install_as_deep_ep()`), under the defaults DeepEP harnesses set
(`torch.set_default_dtype(torch.bfloat16)`, `torch.set_default_device(...)`).

- `megatron`: Megatron-Core's fused_a2a: `get_buffer` re-created when a larger size is needed,
  `Buffer.set_num_sms`, autograd functions whose forward dispatches/combines with
  `EventOverlap(EventHandle())`, `async_finish=True`, `allocate_on_comm_stream=True`, and whose
  backward combines (dispatch) or cached-dispatches (combine) with the kept handle.
- `sglang_normal` / `sglang_ll`: SGLang's DeepEP dispatchers: one buffer sized by the max of the
  config hints and the LL hint, `Buffer.capture()` events, int64 ids, BF16 and FP8 tuples, LL with
  receive hooks, `clean_low_latency_buffer` when switching modes on one (AUTO) buffer.
- `sglang_sbo`: SGLang's single-batch overlap: `low_latency_combine(overlap=True, ...)` with the down
  GEMM's signals (Hopper and Blackwell argument sets), results equal to the combine without it.
- `vllm`: vLLM's all2all managers: buffers built with keyword arguments through a weak-valued
  cache, `Buffer.set_num_sms`, configs only for DeepEP's rank counts, `event.event is not None`,
  LL with `out=`, mask query/clean, `explicitly_destroy` teardown.
- `vllm_clean_buffers`: vLLM's fault-tolerance reset, `get_local_buffer_tensor(torch.int8,
  use_rdma_buffer=True).zero_()` between LL steps (and the NVLink part between normal-mode ones).
- `zero_copy`: `get_next_low_latency_combine_buffer` then `low_latency_combine(zero_copy=True)`.

Every worker returns a dict of what it checked; an `AssertionError` names what failed. Inputs are
made with explicit device and dtype (as the frameworks' own tensors would be on their device),
so anything the library made on torch's default device or dtype shows up as an error. The CPU
suite runs them on 2 and 4 ranks (tests/python/test_frameworks.py), the GPU tier at one rank on
one GPU (tests/gpu/test_frameworks_gpu.py).
"""
import contextlib
import gc
import weakref

import torch
import torch.distributed as dist

HIDDEN = 256
TOPK = 2


@contextlib.contextmanager
def deepep_defaults(default_device):
    """DeepEP harness conventions: bf16 default dtype and a default device, restored after."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(default_device)
    try:
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(old_dtype)


def deep_ep_module():
    import deep_ep_rs

    deep_ep_rs.install_as_deep_ep()
    import deep_ep

    return deep_ep


def tokens(rank, n, dev, ids=True):
    """x [n, HIDDEN] bf16 of small powers of two. With `ids`, row t names itself: x[t, 0] = rank,
    x[t, 1] = t // 8, x[t, 2] = t % 8 (integers <= 8: exact in e4m3 at scale 32). Without, every
    128-channel group has amax 8, so the low-latency FP8 cast (scale 448 / amax) is exact too."""
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    vals = torch.tensor([0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0, 8.0], dtype=torch.float32, device="cpu")
    x = vals[torch.randint(0, len(vals), (n, HIDDEN), generator=g, device="cpu")]
    if ids:
        t = torch.arange(n, dtype=torch.float32, device="cpu")
        x[:, 0], x[:, 1], x[:, 2] = float(rank), t // 8, t % 8
    else:
        x[:, 0::128] = 8.0
    return x.to(torch.bfloat16).to(dev)


def routing(rank, n, num_experts, dev, drop_every=5):
    """topk_idx int64 [n, TOPK] (distinct experts, every `drop_every`-th token's second choice -1) and
    float32 weights 0.5 each."""
    g = torch.Generator(device="cpu").manual_seed(2000 + rank)
    idx = torch.stack([torch.randperm(num_experts, generator=g, device="cpu")[:TOPK] for _ in range(n)])
    idx[::drop_every, 1] = -1
    w = torch.full((n, TOPK), 0.5, dtype=torch.float32, device="cpu")
    return idx.to(dev), w.to(dev)


def ranks_of(idx, num_experts, world):
    """is_token_in_rank [n, world] bool, computed here (not by the library)."""
    per = num_experts // world
    out = torch.zeros((idx.shape[0], world), dtype=torch.bool, device="cpu")
    for r in range(world):
        out[:, r] = ((idx.cpu() >= r * per) & (idx.cpu() < (r + 1) * per)).any(dim=1)
    return out


def gather(obj, world):
    objs = [None] * world
    dist.all_gather_object(objs, obj)
    return objs


def check_normal_recv(recv_x, rank, world, idx_all, num_experts, n):
    """Every received row is the token it names, and exactly the tokens routed to this rank arrive."""
    got = sorted((int(r[0]), int(r[1]) * 8 + int(r[2])) for r in recv_x.float().cpu())
    want = sorted((s, t) for s in range(world) for t in range(n) if ranks_of(idx_all[s], num_experts, world)[t, rank])
    assert got == want, f"rank {rank}: received tokens {got[:8]}... expected {want[:8]}..."
    for row in recv_x.float().cpu():
        s, t = int(row[0]), int(row[1]) * 8 + int(row[2])
        assert torch.equal(row.to(torch.bfloat16), tokens(s, n, "cpu")[t]), f"rank {rank}: row of token ({s}, {t}) differs"


def expect_combined(x, idx, num_experts, world, factor):
    """combine(expert(dispatch(x))) with expert = factor * rows: factor * x * (ranks the token visits)."""
    visits = ranks_of(idx, num_experts, world).sum(dim=1, keepdim=True).float()
    return (x.float().cpu() * visits * factor).to(torch.bfloat16)


# ---- Megatron-Core (fused_a2a) -------------------------------------------------------------------
_MEGATRON_BUFFER = None


def megatron_get_buffer(deep_ep, group, hidden_bytes):
    global _MEGATRON_BUFFER
    nvl, rdma = 0, 0
    for cfg in (deep_ep.Buffer.get_dispatch_config(group.size()), deep_ep.Buffer.get_combine_config(group.size())):
        nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, group.size()), nvl)
        rdma = max(cfg.get_rdma_buffer_size_hint(hidden_bytes, group.size()), rdma)
    b = _MEGATRON_BUFFER
    if b is None or b.group != group or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
        _MEGATRON_BUFFER = deep_ep.Buffer(group, nvl, rdma)
    return _MEGATRON_BUFFER


def _megatron_functions(deep_ep):
    from deep_ep.utils import EventHandle, EventOverlap

    class FusedDispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish, allocate_on_comm_stream):
            previous_event = EventOverlap(EventHandle()) if async_finish else None
            buffer = megatron_get_buffer(deep_ep, group, x.size(1) * max(x.element_size(), 2))
            ntpr, ntprdma, ntpe, in_rank, event = buffer.get_dispatch_layout(
                token_indices, num_experts, previous_event=previous_event, async_finish=async_finish,
                allocate_on_comm_stream=allocate_on_comm_stream)
            recv_x, recv_idx, recv_probs, num_recv, handle, after = buffer.dispatch(
                x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=ntpr,
                num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                previous_event=event, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
            if async_finish:
                after.current_stream_wait()
            ctx.group, ctx.handle, ctx.async_finish, ctx.alloc = group, handle, async_finish, allocate_on_comm_stream
            tokens_per_expert = torch.tensor(num_recv, device="cpu")
            return recv_x, recv_idx, recv_probs, tokens_per_expert, handle

        @staticmethod
        def backward(ctx, grad_out, grad_idx, grad_probs, grad_tpe, grad_handle):
            buffer = megatron_get_buffer(deep_ep, ctx.group, grad_out.size(1) * max(grad_out.element_size(), 2))
            previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
            grad_x, grad_probs, after = buffer.combine(grad_out.contiguous(), ctx.handle, topk_weights=grad_probs.float(),
                                                       previous_event=previous_event, async_finish=ctx.async_finish,
                                                       allocate_on_comm_stream=ctx.alloc)
            if ctx.async_finish:
                after.current_stream_wait()
            return grad_x, None, grad_probs, None, None, None, None

    class FusedCombine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, handle, async_finish, allocate_on_comm_stream):
            buffer = megatron_get_buffer(deep_ep, group, x.size(1) * max(x.element_size(), 2))
            previous_event = EventOverlap(EventHandle()) if async_finish else None
            combined, _, after = buffer.combine(x, handle=handle, async_finish=async_finish, previous_event=previous_event,
                                                allocate_on_comm_stream=allocate_on_comm_stream)
            if async_finish:
                after.current_stream_wait()
            ctx.group, ctx.handle, ctx.async_finish, ctx.alloc = group, handle, async_finish, allocate_on_comm_stream
            return combined

        @staticmethod
        def backward(ctx, grad_out):
            buffer = megatron_get_buffer(deep_ep, ctx.group, grad_out.size(1) * max(grad_out.element_size(), 2))
            previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
            grad_x, _, _, _, _, after = buffer.dispatch(grad_out.contiguous(), handle=ctx.handle, previous_event=previous_event,
                                                         async_finish=ctx.async_finish, allocate_on_comm_stream=ctx.alloc)
            if ctx.async_finish:
                after.current_stream_wait()
            return grad_x, None, None, None, None

    return FusedDispatch, FusedCombine


def megatron(rank, world, dev, default_device):
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        from deep_ep.utils import EventOverlap

        deep_ep.Buffer.set_num_sms(20)
        FusedDispatch, FusedCombine = _megatron_functions(deep_ep)
        group, num_experts, checked = dist.group.WORLD, 4 * world, []
        for step, (n, hidden_scale) in enumerate([(24, 1), (40, 1), (24, 2)]):  # the last one needs a larger buffer
            x = tokens(rank, n, dev)
            if hidden_scale > 1:
                x = torch.cat([x] * hidden_scale, dim=1)
            x.requires_grad_(True)
            idx, probs = routing(rank, n, num_experts, dev)
            probs.requires_grad_(True)
            before = _MEGATRON_BUFFER
            recv_x, recv_idx, recv_probs, tpe, handle = FusedDispatch.apply(x, idx, probs, num_experts, group, True, True)
            assert tpe.dtype == torch.int64 and tpe.device.type == "cpu" and int(tpe.sum()) == int((recv_idx >= 0).sum())
            local = (recv_idx >= 0).to(torch.float32)
            y = recv_x * 2
            out = FusedCombine.apply(y, group, handle, True, True)
            loss = out.float().sum() + (recv_probs * local).sum()
            loss.backward()
            want_out = expect_combined(x.detach()[:, :HIDDEN], idx, num_experts, world, 2.0)
            assert torch.equal(out.detach()[:, :HIDDEN].cpu(), want_out), f"step {step}: combine(2 * dispatch(x))"
            visits = ranks_of(idx, num_experts, world).sum(dim=1, keepdim=True).to(torch.bfloat16)
            assert torch.equal(x.grad.cpu(), (2 * visits).expand(n, x.shape[1]).to(torch.bfloat16)), f"step {step}: x.grad"
            assert torch.equal(probs.grad.cpu(), (idx.cpu() >= 0).to(torch.float32)), f"step {step}: probs.grad"
            if step == 2:
                assert _MEGATRON_BUFFER is not before, "a larger hidden size must re-create the buffer"
            checked.append(f"step {step} ok")
        assert isinstance(EventOverlap(), deep_ep.EventOverlap)
        release_megatron_buffer()
        return checked


def release_megatron_buffer():
    """Megatron keeps its buffer for the process's life; the shared test workers must not."""
    global _MEGATRON_BUFFER
    _MEGATRON_BUFFER = None
    gc.collect()


# ---- SGLang (DeepEP dispatchers) -------------------------------------------------------------------
def sglang_normal(rank, world, dev, default_device):
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        from deep_ep import Buffer, Config

        group, num_experts, n = dist.group.WORLD, 4 * world, 33
        hidden_bytes = HIDDEN * 2
        nvl, rdma = 0, 0
        for cfg in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
            nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, group.size()), nvl)
            rdma = max(cfg.get_rdma_buffer_size_hint(hidden_bytes, group.size()), rdma)
        buffer = Buffer(group, nvl, rdma, low_latency_mode=False, num_qps_per_rank=Buffer.num_sms, allow_mnnvl=True)
        # SGLang's --deepep-config: Config(**json) with DeepEP's keyword names.
        dispatch_cfg = Config(**dict(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                                     num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=128))
        x = tokens(rank, n, dev)
        idx, w = routing(rank, n, num_experts, dev)
        idx_all = gather(idx.cpu(), world)
        out = {}
        for fp8, cfg in ((False, None), (True, dispatch_cfg)):
            if fp8:  # (x_fp8 [n, H] e4m3, scales [n, H/128] f32), the per-token-group cast SGLang makes
                scales = torch.full((n, HIDDEN // 128), 1.0 / 32.0, dtype=torch.float32, device=dev)
                xin = ((x.float() * 32.0).to(torch.float8_e4m3fn), scales)
            else:
                xin = x
            previous_event = Buffer.capture()
            ntpr, ntprdma, ntpe, in_rank, previous_event = buffer.get_dispatch_layout(
                idx, num_experts, previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True)
            recv_x, recv_idx, recv_w, num_recv, handle, event = buffer.dispatch(
                xin, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma,
                is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, previous_event=previous_event, async_finish=True,
                allocate_on_comm_stream=True, expert_alignment=1, config=cfg)
            event.current_stream_wait()
            if fp8:
                assert isinstance(recv_x, tuple) and recv_x[0].dtype == torch.float8_e4m3fn and recv_x[1].dtype == torch.float32
                rows = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=1)).to(torch.bfloat16)
            else:
                rows = recv_x
            check_normal_recv(rows, rank, world, idx_all, num_experts, n)
            assert sum(num_recv) == int((recv_idx >= 0).sum()), "num_recv_tokens_per_expert_list"
            previous_event = Buffer.capture()
            combined, combined_w, event = buffer.combine(rows * 2, handle, async_finish=True, previous_event=previous_event,
                                                         allocate_on_comm_stream=True, config=None)
            event.current_stream_wait()
            assert combined_w is None
            assert torch.equal(combined.cpu(), expect_combined(x, idx, num_experts, world, 2.0)), f"fp8={fp8}: combine"
            out["fp8" if fp8 else "bf16"] = int(rows.shape[0])
        del buffer, handle
        gc.collect()  # non-explicit buffers are released by the destructor (DeepEP's rule)
        return out


def sglang_ll(rank, world, dev, default_device):
    """AUTO mode: one low_latency_mode buffer with NVL bytes serves normal and LL ops; switching to
    LL cleans the LL buffer first. LL with receive hooks, int64 ids, keyword combine."""
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        from deep_ep import Buffer

        group, t_max, num_experts = dist.group.WORLD, 16, 4 * world
        nvl = max(Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(HIDDEN * 2, world),
                  Buffer.get_combine_config(world).get_nvl_buffer_size_hint(HIDDEN * 2, world))
        rdma = Buffer.get_low_latency_rdma_size_hint(t_max, HIDDEN, group.size(), num_experts)
        buffer = Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=max(Buffer.num_sms, num_experts // world),
                        allow_mnnvl=True)
        assert buffer.low_latency_mode and buffer.group_size == world
        done = {}
        for step in range(3):
            n = [16, 5, 0][step] if rank == 0 else [16, 11, 3][step]
            x = tokens(rank, max(n, 1), dev)[:n]
            x_ll = tokens(rank, max(n, 1), dev, ids=False)[:n]
            idx, w = routing(rank, max(n, 1), num_experts, dev)
            idx, w = idx[:n].to(torch.int64), w[:n]
            # normal mode on the same buffer, then back to LL (SGLang's set_dispatch_mode_as_low_latency)
            ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
            recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntpr,
                                                         is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
            combined, _, _ = buffer.combine(recv_x, handle)
            assert torch.equal(combined.cpu(), expect_combined(x, idx, num_experts, world, 1.0)), f"step {step}: normal on AUTO buffer"
            if buffer.low_latency_mode:
                buffer.clean_low_latency_buffer(t_max, HIDDEN, num_experts)
            for use_fp8 in (False, True):
                recv, count, handle, event, hook = buffer.low_latency_dispatch(
                    x_ll, idx, t_max, num_experts, use_fp8=use_fp8, async_finish=False, return_recv_hook=True,
                    round_scale=False, use_ue8m0=False)
                hook()
                assert count.dtype == torch.int32 and count.shape == (num_experts // world,)
                if use_fp8:
                    q, s = recv
                    y = (q.float() * s.repeat_interleave(128, dim=2)).to(torch.bfloat16)
                else:
                    y = recv
                combined, event, hook = buffer.low_latency_combine(x=y, topk_idx=idx, topk_weights=w, handle=handle,
                                                                    async_finish=False, return_recv_hook=True)
                hook()
                valid = (idx.cpu() >= 0).to(torch.float32).sum(dim=1, keepdim=True) * 0.5
                want = (x_ll.float().cpu() * valid).to(torch.bfloat16)
                assert combined.shape == (n, HIDDEN) and combined.dtype == torch.bfloat16
                assert torch.equal(combined.cpu(), want), f"step {step} fp8={use_fp8}: LL dispatch + combine"
                done[f"step{step}_fp8_{use_fp8}"] = int(count.sum())
        del buffer, handle, hook
        gc.collect()
        return done


def sglang_sbo(rank, world, dev, default_device):
    """SGLang's single-batch overlap (`_combine_core` with `CombineOverlapArgs`): the LL combine gets
    `overlap=True` and the down GEMM's signals, Hopper's (`packed_recv_count`, `comp_signal`,
    `block_m`, `threshold`, `num_sms`) or Blackwell's (`src_signals`, `src_signal_expect_value`),
    inside `torch.cuda.stream(alt_stream)` after `alt_stream.wait_event(wait_event)` on GPUs. The
    "GEMM" here raises every signal once its output is written; results must be those of the combine
    without overlap, bit for bit. On GPUs the combine is ordered after the GEMM's start only (as
    SGLang orders it), so its send must wait for the signals on the device. A signal that is not
    raised is an error on CPU buffers (it can never come), on every rank alike, and the buffer goes on."""
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        from deep_ep import Buffer

        group, t_max, num_experts, n = dist.group.WORLD, 16, 4 * world, 11
        el = num_experts // world
        buffer = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(t_max, HIDDEN, world, num_experts), low_latency_mode=True,
                        num_qps_per_rank=el, explicitly_destroy=True)
        x = tokens(rank, n, dev, ids=False)
        idx, w = routing(rank, n, num_experts, dev)
        want = (x.float().cpu() * ((idx.cpu() >= 0).to(torch.float32).sum(dim=1, keepdim=True) * 0.5)).to(torch.bfloat16)
        block_m, n_blocks = 64, HIDDEN // 128  # DeepGEMM: threshold = ceil(N / block_n)
        per_expert = -(-world * t_max // block_m)
        compute_num_sms, communicate_num_sms = 100, 32
        alt_stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None

        def step(overlap_args, return_recv_hook=True):
            recv, packed_recv_count, handle, _, hook = buffer.low_latency_dispatch(
                x, idx, t_max, num_experts, use_fp8=False, async_finish=False, return_recv_hook=return_recv_hook)
            if hook is not None:
                hook()
            counts = packed_recv_count.tolist()  # before the GEMM: no host sync may wait for it below
            kwargs = overlap_args(packed_recv_count, handle)
            raise_ = kwargs.pop("_raise", True)
            waits = raise_ and (kwargs.get("threshold", 0) > 0 or kwargs.get("src_signal_expect_value", 0) > 0)
            # SGLang records this event at the down GEMM's start and lets the signals cover the
            # rest: the combine on alt_stream may run while the GEMM does, so on GPUs its send must
            # wait on the device (the GEMM sleeps first to make that likely). Forms without a wait
            # are ordered after the whole GEMM (their caller's duty).
            y = torch.empty_like(recv)
            gemm_event = torch.cuda.Event() if alt_stream is not None else None
            if gemm_event is not None and waits:
                gemm_event.record()
                torch.cuda._sleep(2_000_000)
            torch.mul(recv, 2, out=y)  # the down GEMM
            if raise_:  # the GEMM raises its signals as it finishes (all of them here)
                if kwargs.get("comp_signal") is not None:
                    for l, r in enumerate(counts):
                        kwargs["comp_signal"][l * per_expert:l * per_expert + -(-r // block_m)] = kwargs["threshold"]
                if kwargs.get("src_signals") is not None:
                    kwargs["src_signals"].fill_(kwargs["src_signal_expect_value"])
            if gemm_event is not None and not waits:
                gemm_event.record()
            ctx = contextlib.nullcontext()
            if alt_stream is not None and kwargs.get("overlap"):
                alt_stream.wait_event(gemm_event)
                ctx = torch.cuda.stream(alt_stream)
            with ctx:
                combined, event, hook = buffer.low_latency_combine(x=y, topk_idx=idx, topk_weights=w, handle=handle,
                                                                    async_finish=not return_recv_hook,
                                                                    return_recv_hook=return_recv_hook, **kwargs)
                if hook is not None:  # on the send's stream: the receive reads the send's recv_state
                    hook()
            if event is not None and event.event is not None:
                event.current_stream_wait()
            if alt_stream is not None:
                torch.cuda.current_stream().wait_stream(alt_stream)
            return (combined.float() / 2).to(torch.bfloat16).cpu()

        hopper = lambda thr: lambda count, handle: dict(  # noqa: E731
            overlap=True, packed_recv_count=count, comp_signal=torch.zeros(el * per_expert, dtype=torch.int32, device=dev),
            block_m=block_m, threshold=thr, num_sms=communicate_num_sms)
        blackwell = lambda value: lambda count, handle: dict(  # noqa: E731
            overlap=True, src_signals=torch.zeros(el, dtype=torch.uint32, device=dev), src_signal_expect_value=value)
        cases = {"no overlap args": lambda count, handle: {},
                 "overlap=False (args ignored)": lambda count, handle: dict(overlap=False, packed_recv_count=count, num_sms=32,
                                                                            _raise=False),
                 "hopper, threshold 0 (no wait)": hopper(0), "blackwell, expect 0 (no wait)": blackwell(0)}
        waiting = {"hopper": hopper(n_blocks), "blackwell": blackwell(compute_num_sms)}
        done = {}
        for name, args in cases.items():
            got = step(args)
            assert torch.equal(got, want), f"{name}: combine differs from the reference"
            done[name] = True
        for name, args in waiting.items():
            for hook in (True, False):
                got = step(args, return_recv_hook=hook)
                assert torch.equal(got, want), f"{name} (hook={hook}): overlap combine differs from the one without"
            if dev.type == "cuda":  # a signal never raised: tests/gpu/test_ll_overlap_gpu.py (a timeout)
                done[name] = True
                continue
            # The GEMM never raised its signals: an error on every rank, before anything is sent.
            unraised = lambda count, handle, a=args: dict(a(count, handle), _raise=False)  # noqa: E731
            try:
                step(unraised)
            except RuntimeError as e:
                assert "will never come" in str(e), e
            else:
                raise AssertionError(f"{name}: unraised signals must raise on a CPU buffer")
            done[name] = True
        assert torch.equal(step(cases["no overlap args"]), want), "the buffer goes on after the refused combines"
        buffer.destroy()
        return done


# ---- vLLM (all2all managers) ------------------------------------------------------------------------
class _Cache:
    """vLLM's handle cache: weak values keyed on the sorted keyword arguments."""

    def __init__(self):
        self._cache = weakref.WeakValueDictionary()

    def get_or_create(self, kwargs, func):
        key = tuple(sorted((k, v) for k, v in kwargs.items()))
        h = self._cache.get(key)
        if h is None:
            h = func(**kwargs)
            self._cache[key] = h
        return h


def vllm(rank, world, dev, default_device):
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        cache, group, t_max, num_experts = _Cache(), dist.group.WORLD, 32, 4 * world
        ht = cache.get_or_create(dict(group=group, num_nvl_bytes=1 << 22, num_rdma_bytes=0, low_latency_mode=False,
                                      num_qps_per_rank=1, explicitly_destroy=True), deep_ep.Buffer)
        assert cache.get_or_create(dict(group=group, num_nvl_bytes=1 << 22, num_rdma_bytes=0, low_latency_mode=False,
                                        num_qps_per_rank=1, explicitly_destroy=True), deep_ep.Buffer) is ht
        deep_ep.Buffer.set_num_sms(min(20, 20))
        cfg = deep_ep.Buffer.get_dispatch_config(world) if world in [2, 4, 8, 16, 24, 32, 64, 128, 144, 160] else None
        ccfg = deep_ep.Buffer.get_combine_config(world) if world in [2, 4, 8, 16, 24, 32, 64, 128, 144, 160] else None
        n = 21
        x = tokens(rank, n, dev)
        idx, w = routing(rank, n, num_experts, dev)
        ntpr, ntprdma, ntpe, in_rank, event = ht.get_dispatch_layout(topk_idx=idx, num_experts=num_experts, previous_event=None,
                                                                     async_finish=False, allocate_on_comm_stream=False)
        recv_x, recv_idx, recv_w, num_recv, handle, event = ht.dispatch(
            x=x, handle=None, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w, expert_alignment=1, config=cfg, previous_event=None,
            async_finish=True, allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        check_normal_recv(recv_x, rank, world, gather(idx.cpu(), world), num_experts, n)
        combined, _, event = ht.combine(x=recv_x, handle=handle, topk_weights=None, config=ccfg, previous_event=None,
                                        async_finish=True, allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        assert torch.equal(combined.cpu(), expect_combined(x, idx, num_experts, world, 1.0)), "HT combine"

        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=t_max, hidden=HIDDEN,
                                                             num_ranks=world, num_experts=num_experts)
        ll = cache.get_or_create(dict(group=group, num_nvl_bytes=1 << 22, num_rdma_bytes=rdma, low_latency_mode=True,
                                      num_qps_per_rank=num_experts // world, allow_nvlink_for_low_latency_mode=True,
                                      allow_mnnvl=False, explicitly_destroy=True, enable_shrink=False), deep_ep.Buffer)
        output = torch.empty((n, HIDDEN), dtype=torch.bfloat16, device=dev)
        for do_async in (False, True):
            expert_x, expert_num_tokens, h, _, hook = ll.low_latency_dispatch(x, idx, t_max, num_experts, use_fp8=False,
                                                                             round_scale=False, use_ue8m0=False,
                                                                             async_finish=False, return_recv_hook=True)
            hook()
            _, _, recv_hook = ll.low_latency_combine(expert_x, idx, torch.ones_like(w), h, async_finish=False, zero_copy=False,
                                                     return_recv_hook=do_async, out=output)
            if recv_hook is not None:
                recv_hook()
            valid = (idx.cpu() >= 0).to(torch.float32).sum(dim=1, keepdim=True)
            assert torch.equal(output.cpu(), (x.float().cpu() * valid).to(torch.bfloat16)), f"LL combine into out (hook={do_async})"
        mask = torch.zeros(world, device=dev, dtype=torch.int32)
        ll.low_latency_query_mask_buffer(mask)
        assert int(mask.sum()) == 0
        if world > 1:  # mask a peer locally, see it in the query, unmask all
            ll.low_latency_update_mask_buffer((rank + 1) % world, True)
            ll.low_latency_query_mask_buffer(mask)
            assert mask.cpu().tolist() == [int(r == (rank + 1) % world) for r in range(world)], mask
        ll.low_latency_clean_mask_buffer()
        ll.low_latency_query_mask_buffer(mask)
        assert int(mask.sum()) == 0
        for b in (ht, ll):  # vLLM's destroy(): every cached buffer, then the cache
            b.destroy()
        return {"ht_rows": int(recv_x.shape[0]), "ll_rows": int(expert_num_tokens.sum())}


def vllm_clean_buffers(rank, world, dev, default_device):
    """vLLM's fault-tolerance reset (`clean_buffers`): LL steps, then
    `get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()` on every rank and a group
    barrier, then LL steps again that must give the same results (BF16, FP8, top-k weights carried
    by the dispatch, receive hooks); the NVLink part zeroed the same way between normal-mode
    round trips of the same (AUTO) buffer."""
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        group, t_max, num_experts, n = dist.group.WORLD, 16, 4 * world, 13
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(t_max, HIDDEN, world, num_experts)
        buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 22, num_rdma_bytes=rdma, low_latency_mode=True,
                             num_qps_per_rank=num_experts // world, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                             explicitly_destroy=True, enable_shrink=False)
        x, x_ll = tokens(rank, n, dev), tokens(rank, n, dev, ids=False)
        idx, w = routing(rank, n, num_experts, dev)
        valid = (idx.cpu() >= 0).to(torch.float32).sum(dim=1, keepdim=True) * 0.5
        want_ll = (x_ll.float().cpu() * valid).to(torch.bfloat16)

        def ll_steps():
            out = {}
            for use_fp8, carry_weights, hook in ((False, False, False), (True, False, True), (False, True, False)):
                recv, count, handle, _, h = buf.low_latency_dispatch(x_ll, idx, t_max, num_experts, use_fp8=use_fp8,
                                                                     return_recv_hook=hook, topk_weights=w if carry_weights else None)
                if h is not None:
                    h()
                y = (recv[0].float() * recv[1].repeat_interleave(128, dim=2)).to(torch.bfloat16) if use_fp8 else recv
                combined, _, h = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
                if h is not None:
                    h()
                assert torch.equal(combined.cpu(), want_ll), f"LL fp8={use_fp8} weights={carry_weights}"
                out[(use_fp8, carry_weights)] = int(count.sum())
            return out

        def normal_round_trip():
            ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntpr,
                                                      is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
            check_normal_recv(recv_x, rank, world, gather(idx.cpu(), world), num_experts, n)
            combined, _, _ = buf.combine(recv_x, handle)
            assert torch.equal(combined.cpu(), expect_combined(x, idx, num_experts, world, 1.0)), "normal round trip"
            return int(recv_x.shape[0])

        counts = [ll_steps()]
        rows = [normal_round_trip()]
        for reset in range(2):
            # vLLM's clean_buffers on every rank, then the group meets before any rank's next op.
            raw = buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
            assert raw.dtype == torch.int8 and raw.shape == (rdma,) and raw.device == dev, (raw.dtype, raw.shape, raw.device)
            assert bool(raw.any()), "the LL part holds the earlier calls' signals and messages"
            raw.zero_()
            del raw
            nvl = buf.get_local_buffer_tensor(torch.int32, use_rdma_buffer=False)
            assert nvl.shape == ((1 << 22) // 4,) and nvl.device == dev
            nvl.fill_(-1 if reset else 0)  # any content: normal-mode ops stage afresh every call
            del nvl
            dist.barrier(group)
            counts.append(ll_steps())
            rows.append(normal_round_trip())
        assert all(c == counts[0] for c in counts) and all(r == rows[0] for r in rows), (counts, rows)
        buf.destroy()
        return {"ll_rows": counts[0][(False, False)], "ht_rows": rows[0], "resets": 2}


# ---- zero-copy combine (DeepEP's test_low_latency) ------------------------------------------------
def zero_copy(rank, world, dev, default_device):
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        t_max, num_experts, n = 8, 2 * world, 7
        buf = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(t_max, HIDDEN, world, num_experts),
                             low_latency_mode=True, explicitly_destroy=True)
        x = tokens(rank, n, dev)
        idx, w = routing(rank, n, num_experts, dev)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t_max, num_experts, use_fp8=False)
        view = buf.get_next_low_latency_combine_buffer(handle)
        assert view.dtype == torch.bfloat16 and view.shape == recv.shape and view.device == recv.device
        view.copy_(recv * 2)
        out, _, _ = buf.low_latency_combine(recv, idx, w, handle, zero_copy=True)
        valid = (idx.cpu() >= 0).to(torch.float32).sum(dim=1, keepdim=True)
        assert torch.equal(out.cpu(), (x.float().cpu() * valid).to(torch.bfloat16)), "zero-copy combine"
        del view
        buf.destroy()
        return {"rows": int(count.sum())}


def nvfp4(rank, world, dev, default_device):
    """SGLang's and vLLM's NVFP4 low-latency dispatch (the DeepEP forks' `use_nvfp4`, docs/NVFP4.md):
    the global scale all-reduced with MIN as the fork's test builds it; SGLang passes use_fp8=False
    and async_finish; vLLM return_recv_hook=True, then permutes the data view back to (L, M, H/2)
    and keeps the 6-D scales view. Every received row's bytes and scales equal the torch reference
    of its source token; the combine of the handle takes BF16 expert outputs as before."""
    import _reference as ref
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep_module()
        from deep_ep import Buffer

        group, t_max, num_experts = dist.group.WORLD, 16, 4 * world
        el = num_experts // world
        buffer = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(t_max, HIDDEN, world, num_experts), low_latency_mode=True,
                        num_qps_per_rank=el)
        sizes = [11 if r == 0 else 7 for r in range(world)]
        xs = [(tokens(r, sizes[r], "cpu", ids=False).float() * (0.3 + 0.2 * r)).to(torch.bfloat16) for r in range(world)]
        x = xs[rank].to(dev)
        idx, w = routing(rank, sizes[rank], num_experts, dev)
        gs = torch.tensor([448.0 * 6.0], dtype=torch.float32, device=dev) / x.float().abs().max()
        dist.all_reduce(gs, op=dist.ReduceOp.MIN)
        s = float(gs)
        want = [ref.nvfp4_quantize(xr, s) for xr in xs]
        done = {}
        for caller in ("sglang", "vllm"):
            if caller == "sglang":
                recv, count, handle, event, hook = buffer.low_latency_dispatch(
                    x, idx, t_max, num_experts, use_fp8=False, use_nvfp4=True, x_global_scale=gs, async_finish=True,
                    return_recv_hook=False)
                event.current_stream_wait()
                q, scales = recv[0].permute(2, 0, 1), recv[1]
            else:
                recv, count, handle, event, hook = buffer.low_latency_dispatch(
                    x, idx, t_max, num_experts, use_fp8=False, round_scale=False, use_ue8m0=False, use_nvfp4=True,
                    x_global_scale=gs, async_finish=False, return_recv_hook=True)
                hook()
                q, scales = recv[0].permute(2, 0, 1), recv[1]  # vLLM's _do_quant
                assert q.is_contiguous() and 2 * q.shape[2] == HIDDEN and scales.dim() == 6
            unsw = ref.nvfp4_unswizzle(scales.cpu().view(torch.uint8))
            src_info, layout_range = handle[0].cpu(), handle[1].cpu()
            y = torch.zeros((el, world * t_max, HIDDEN), dtype=torch.bfloat16, device="cpu")
            for l in range(el):
                for src in range(world):
                    begin, n = int(layout_range[l, src]) >> 32, int(layout_range[l, src]) & 0xFFFFFFFF
                    for r in range(begin, begin + n):
                        tok = int(src_info[l, r])
                        assert torch.equal(q[l, r].cpu(), want[src][0][tok]), f"{caller}: expert {l} row {r} (rank {src} token {tok})"
                        assert torch.equal(unsw[l, r, :HIDDEN // 16], want[src][1][tok]), f"{caller}: scales of expert {l} row {r}"
                        y[l, r] = ref.nvfp4_dequantize(q[l, r].cpu().unsqueeze(0), unsw[l, r, :HIDDEN // 16].unsqueeze(0), s)[0]
            combined, _, _ = buffer.low_latency_combine(y.to(dev), idx, w, handle)
            deq = ref.nvfp4_dequantize(want[rank][0], want[rank][1], s).to(torch.bfloat16).float()
            expect = (idx.cpu() >= 0).float().sum(dim=1, keepdim=True) * 0.5 * deq
            assert torch.allclose(combined.float().cpu(), expect, rtol=1e-2, atol=1e-3), f"{caller}: combine of an NVFP4 handle"
            done[caller] = int(count.sum())
        del buffer, handle, hook
        gc.collect()
        return done


WORKERS = {"megatron": megatron, "sglang_normal": sglang_normal, "sglang_ll": sglang_ll, "vllm": vllm,
           "vllm_clean_buffers": vllm_clean_buffers, "sglang_sbo": sglang_sbo, "zero_copy": zero_copy, "nvfp4": nvfp4}
