"""A small MoE step on the deep_ep ops, for serialization tests and examples: `prefill` = layout +
normal dispatch (num_worst_tokens, static shapes) + combine, `decode` = low-latency dispatch +
combine. Built with a slot handle (`deep_ep_rs.slot_handle(slot)`), so a scripted or exported
copy runs in any process that binds its own buffer to the slot.

    python _serialized_model.py make DIR    # buffer bound to slot 0; writes model.pt (TorchScript),
                                            # model.pt2 (torch.export), model_aoti.pt2 (AOTInductor
                                            # package), the same of the LL half through the hook
                                            # ops (hook.pt, hook.pt2, hook_aoti.pt2) and io.pt
    python _serialized_model.py load DIR    # another process: own buffers, slot 0 bound, loads and
                                            # compares bit for bit; prints one OK line per artifact
"""
import os
import sys
import torch

import deep_ep_rs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from export_moe_layer import SavedIO  # noqa: E402  (the servers' io_ts.pt format)

N, H, K, E, T = 6, 256, 2, 4, 8
CONFIG = [20, 6, 256, 6, 128]
#: DEEP_EP_MODEL_DEVICE=cuda: buffers on cuda:0 (nccl backend, one rank) and CUDA inputs; the
#: loader then also captures the loaded AOTInductor model in a CUDA graph and replays it.
DEV = torch.device(os.environ.get("DEEP_EP_MODEL_DEVICE", "cpu"))


class MoeStep(torch.nn.Module):
    def __init__(self, handle: int):
        super().__init__()
        self.handle, self.n, self.h, self.e, self.t = handle, N, H, E, T
        self.config = list(CONFIG)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
        ops = torch.ops.deep_ep
        ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, self.e, 1)
        recv_x, _, _, _, _, rpm, cpm, rcpm, src_idx, send_head = ops.dispatch(self.handle, x, None, idx, w, ntpr, in_rank, ntpe, 1, self.n,
                                                                              self.config)
        prefill, _ = ops.combine(self.handle, recv_x * 2, None, None, None, rpm, cpm, rcpm, src_idx, in_rank, send_head, self.config)
        return prefill, self.decode(x, idx, w)

    def decode(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.deep_ep
        lrecv, _, _, src_info, layout_range = ops.low_latency_dispatch(self.handle, x, idx, None, None, None, self.t, self.e, False, False,
                                                                       False)
        out = torch.empty((self.n, self.h), dtype=torch.bfloat16, device=x.device)
        ops.low_latency_combine(self.handle, lrecv * 3, idx, w, src_info, layout_range, out, None, self.t, self.e, False, False)
        return out


class DecodeStep(MoeStep):
    """The low-latency half alone (static shapes, no host sync): what a decode loop captures."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
        return self.decode(x, idx, w)


class HookStep(MoeStep):
    """The low-latency half through the hook ops (DeepEP's return_recv_hook=True: send, other
    work, then the receive that fills the send's outputs in place), equal to `decode` bit for bit."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
        ops = torch.ops.deep_ep
        lrecv, scales, count, src_info, layout_range, state = ops.low_latency_dispatch_send(self.handle, x, idx, None, self.t, self.e, False,
                                                                                            False, False)
        other = x.float().sum()  # work that overlaps the transfer (here: nothing depends on it)
        ops.low_latency_dispatch_recv(self.handle, state, lrecv, scales, count, src_info, layout_range, None, None, self.t, self.e, False,
                                      False, False)
        cstate = ops.low_latency_combine_send(self.handle, lrecv * 3, src_info, layout_range, self.t, self.e, False, False)
        out = torch.empty((self.n, self.h), dtype=torch.bfloat16, device=x.device)
        ops.low_latency_combine_recv(self.handle, cstate, idx, w, out, None, self.t, self.h, self.e)
        return out, other


def buffer(slot=None):
    ops = torch.ops.deep_ep
    dev = torch.device("cuda", 0) if DEV.type == "cuda" else DEV
    backend = "cpu" if dev.type == "cpu" else ""
    h = int(ops.create_buffer(ops.get_unique_id(backend, dev), 0, 1, dev, 1 << 22, ops.low_latency_rdma_size_hint(T, H, 1, E), True,
                              backend))
    if slot is not None:
        ops.bind_buffer_slot(h, slot)
    return h


def inputs():
    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn((N, H), generator=g, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2], [-1, -1], [3, 2]], dtype=torch.int64, device="cpu")
    w = torch.full((N, K), 0.5, dtype=torch.float32, device="cpu")
    return x.to(DEV), idx.to(DEV), w.to(DEV)


def make(d):
    buffer(slot=0)
    model = MoeStep(deep_ep_rs.slot_handle(0))
    args = inputs()
    want = model(*args)
    torch.jit.save(torch.jit.script(model), f"{d}/model.pt")
    ep = torch.export.export(model, args)
    torch.export.save(ep, f"{d}/model.pt2")
    torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/model_aoti.pt2")  # AOTInductor, C++ wrapper
    hooked = HookStep(deep_ep_rs.slot_handle(0))
    assert torch.equal(hooked(*args)[0], want[1]), "hook ops differ from low_latency_dispatch/combine"
    torch.jit.save(torch.jit.script(hooked), f"{d}/hook.pt")
    ep = torch.export.export(hooked, args)
    torch.export.save(ep, f"{d}/hook.pt2")
    torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/hook_aoti.pt2")
    if DEV.type == "cuda":
        decode = torch.export.export(DecodeStep(deep_ep_rs.slot_handle(0)), args)
        torch._inductor.aoti_compile_and_package(decode, package_path=f"{d}/decode_aoti.pt2")
    torch.save({"args": args, "want": want}, f"{d}/io.pt")
    # The same for C++ and Rust (examples/cpp_server/model_server.cpp, examples/tch_server): a
    # scripted module whose buffers (and forward) hold them.
    torch.jit.save(torch.jit.script(SavedIO(list(args), *want, E, T)), f"{d}/io_ts.pt")
    print("MADE")


def load(d):
    io = torch.load(f"{d}/io.pt")
    scripted = torch.jit.load(f"{d}/model.pt")
    try:  # nothing bound to slot 0 yet: a clear error, not another process's buffer
        scripted(*io["args"])
        print("UNBOUND RAN")
    except RuntimeError as e:
        print("UNBOUND:", next((line for line in str(e).splitlines() if "slot" in line), str(e)))
    other = buffer()  # this process's handles differ from the maker's
    h = buffer(slot=0)
    assert h != 1 and other != h
    artifacts = (("torchscript", scripted), ("export", torch.export.load(f"{d}/model.pt2").module()),
                 ("aoti", torch._inductor.aoti_load_package(f"{d}/model_aoti.pt2")))
    for name, fn in artifacts:
        got = fn(*io["args"])
        assert all(torch.equal(a, b) for a, b in zip(got, io["want"])), name
        print(f"OK {name} (handle {h} bound to slot 0)")
    hooked = (("torchscript", torch.jit.load(f"{d}/hook.pt")), ("export", torch.export.load(f"{d}/hook.pt2").module()),
              ("aoti", torch._inductor.aoti_load_package(f"{d}/hook_aoti.pt2")))
    for name, fn in hooked:  # the LL half through the hook ops (send, other work, receive)
        assert torch.equal(fn(*io["args"])[0], io["want"][1]), f"{name} hook"
        print(f"OK {name} LL hooks")
    if DEV.type == "cuda":  # the loaded AOTI decode step, captured once and replayed
        # run_single_threaded: the package's default runner records and queries a "run finished"
        # event per call, which a capturing stream refuses ("operation not permitted when stream is
        # capturing"); torch documents this flag for CUDA graphs.
        for name, pkg in (("decode step", "decode_aoti.pt2"), ("decode step through the hook ops", "hook_aoti.pt2")):
            decode = torch._inductor.aoti_load_package(f"{d}/{pkg}", run_single_threaded=True)
            static = [a.clone() for a in io["args"]]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                decode(*static)  # warm-up on the capture stream
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = decode(*static)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            out = out[0] if isinstance(out, (list, tuple)) else out
            assert torch.equal(out, io["want"][1]), f"aoti {name} graph replay"
            print(f"OK aoti {name} in a CUDA graph (3 replays)")


if __name__ == "__main__":
    {"make": make, "load": load}[sys.argv[1]](sys.argv[2])
