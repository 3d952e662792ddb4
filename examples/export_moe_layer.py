"""Scripts and exports examples/moe_layer.py for serving without Python, with inputs and expected
outputs beside the artifacts: what examples/cpp_server/model_server.cpp (C++) and
examples/tch_server (Rust) load.

    python examples/export_moe_layer.py OUT_DIR [--device cpu|cuda]

One rank. The layer is built on the slot handle `deep_ep_rs.slot_handle(0)`, not on this
process's buffer handle, so a server runs the artifacts against its own buffer once it binds it
to slot 0 (docs/OPS.md "Handles in serialized models"). Writes:
- model.pt        TorchScript of `Serve`: forward(x) -> (prefill(x), decode(x)), i.e. the normal ops
                  (layout, dispatch with num_worst_tokens, expert MLP, combine) then the LL ops;
- model.pt2       the same through torch.export;
- model_aoti.pt2  the same as an AOTInductor package;
- decode_aoti.pt2 (--device cuda) the decode half alone as an AOTInductor package: what a decode
                  loop captures in a CUDA graph (load it with run_single_threaded);
- io_ts.pt        a scripted module whose forward() returns [num_inputs, x, prefill, decode,
                  num_experts, max_decode_tokens] (`SavedIO`).
"""
import argparse
import os
import sys

import torch

from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deep_ep_rs  # noqa: E402
from moe_layer import MoELayer  # noqa: E402

TOKENS, HIDDEN, EXPERTS_PER_RANK, TOPK, MAX_DECODE = 8, 128, 4, 2, 8


class SavedIO(torch.nn.Module):
    """Inputs and expected outputs for the C++ / Rust servers (io_ts.pt): forward() returns the list
    [num_inputs, *inputs, prefill, decode, num_experts, num_max_dispatch_tokens_per_rank] (counts
    as 0-d int64 tensors); the model's forward takes the inputs and returns (prefill, decode)."""

    items: List[torch.Tensor]

    def __init__(self, inputs, prefill, decode, num_experts, max_tokens):
        super().__init__()
        self.items = [torch.tensor(len(inputs))] + list(inputs) + [prefill, decode, torch.tensor(num_experts), torch.tensor(max_tokens)]

    def forward(self) -> List[torch.Tensor]:
        return self.items


class Serve(torch.nn.Module):
    """The layer's prefill (static shapes: num_worst_tokens = TOKENS) and decode on one input."""

    def __init__(self, layer: MoELayer, num_worst_tokens: int):
        super().__init__()
        self.layer, self.num_worst_tokens = layer, num_worst_tokens

    def forward(self, x: torch.Tensor):
        return self.layer.prefill(x, self.num_worst_tokens), self.layer.decode(x)


class Decode(torch.nn.Module):
    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor):
        return self.layer.decode(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    ops = torch.ops.deep_ep
    backend = "cpu" if dev.type == "cpu" else ""
    e = EXPERTS_PER_RANK
    h = int(ops.create_buffer(ops.get_unique_id(backend, dev), 0, 1, dev, 1 << 22, ops.low_latency_rdma_size_hint(MAX_DECODE, HIDDEN, 1, e),
                              True, backend))
    ops.bind_buffer_slot(h, 0)
    with torch.no_grad():
        layer = MoELayer(deep_ep_rs.slot_handle(0), 1, 0, hidden=HIDDEN, experts_per_rank=EXPERTS_PER_RANK, topk=TOPK,
                         max_decode_tokens=MAX_DECODE, device=dev).eval()
        for prm in layer.parameters():
            prm.requires_grad_(False)
        serve = Serve(layer, TOKENS)
        g = torch.Generator(device="cpu").manual_seed(11)
        x = torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16).to(dev)
        prefill, decode = serve(x)
        torch.jit.save(torch.jit.script(serve), f"{a.out}/model.pt")
        ep = torch.export.export(serve, (x,))
        torch.export.save(ep, f"{a.out}/model.pt2")
        torch._inductor.aoti_compile_and_package(ep, package_path=f"{a.out}/model_aoti.pt2")
        if dev.type == "cuda":
            torch._inductor.aoti_compile_and_package(torch.export.export(Decode(layer), (x,)), package_path=f"{a.out}/decode_aoti.pt2")
        torch.jit.save(torch.jit.script(SavedIO([x], prefill, decode, e, MAX_DECODE)), f"{a.out}/io_ts.pt")
    ops.destroy_buffer(h)
    print(f"exported examples/moe_layer.py to {a.out} ({dev}): model.pt, model.pt2, model_aoti.pt2"
          + (", decode_aoti.pt2" if dev.type == "cuda" else "") + ", io_ts.pt")


if __name__ == "__main__":
    main()
