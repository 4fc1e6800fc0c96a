"""Run a decoder whose weights are larger than the device budget.

On a GPU: a 7B-shaped bf16 decoder stack (16 layers, 6.5 GB) under a 2 GiB
budget. Without one: a small fp32 decoder on the CPU device (host memory
stands for device memory), same paging code, checked against the unpaged model.

    python examples/run_big_model.py [--budget 2GiB] [--layers 16] [--split-fetch all]

The file stands alone: after `pip install pager` it runs from any folder
(the model is defined below). `--layers 4` makes the CPU run quicker.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import pager


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class DecoderLayer(nn.Module):
    """A Llama-like layer: causal attention and a gated MLP, each after an RMSNorm."""

    def __init__(self, d=4096, ff=11008, heads=32):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    """A stack of decoder layers (7B-shaped by default: 404 MB a layer in bf16); each layer is a block."""

    def __init__(self, n_layers=16, d=4096, ff=11008, heads=32):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(d, ff, heads) for _ in range(n_layers))
        self.norm = RMSNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def layer_bytes(model: Decoder) -> int:
    return sum(p.numel() * p.element_size() for p in model.layers[0].parameters())


def main():
    ap = argparse.ArgumentParser()
    cuda = torch.cuda.is_available()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", default="2GiB" if cuda else None)
    ap.add_argument(
        "--compress",
        choices=["lossless", "fp8", "int4"],
        default=None,
        help="weights compressed in their host pages, decoded on the device (bf16 models; on the CPU "
        "the example's model is bf16 then)",
    )
    ap.add_argument(
        "--split-fetch",
        default=None,
        help='other GPUs whose links carry a share of every fetch: "all" or "cuda:1,cuda:2" (docs/split-fetch.md)',
    )
    args = ap.parse_args()
    split = args.split_fetch if args.split_fetch in (None, "all") else args.split_fetch.split(",")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if cuda:
        device, dtype = "cuda", torch.bfloat16
        x = torch.randn(1, 512, 4096, device=device, dtype=dtype)
        with torch.device("meta"):  # no time spent on an initialisation that is overwritten
            model = Decoder(n_layers=args.layers).to(dtype)
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        reference = None
    else:
        device = "cpu"
        dtype = torch.bfloat16 if args.compress else torch.float32
        x = torch.randn(2, 64, 256, dtype=dtype)
        model = Decoder(n_layers=args.layers, d=256, ff=688, heads=4).to(dtype).eval()
        reference = copy.deepcopy(model)

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = args.budget or 3 * layer_bytes(model)
    pager.wrap(model, budget=budget, device=device, compress=args.compress, split_fetch=split)
    pg = pager.of(model)
    if reference is not None and args.compress in ("fp8", "int4"):
        reference.load_state_dict(model.state_dict())  # lossy: the model computes with the decoded weights
    print(
        f"model: {len(pg.blocks)} blocks, {pager.format_bytes(weights)} of weights; "
        f"budget {pager.format_bytes(pg.budget_bytes)} on {device}"
    )

    with torch.no_grad():
        for i in range(3):
            t0 = time.perf_counter()
            y = model(x)
            if cuda:
                torch.cuda.synchronize()
            print(f"forward {i}: {1e3 * (time.perf_counter() - t0):.1f} ms")
    s = pg.stats()
    print(s)
    assert s.peak_resident_bytes <= pg.budget_bytes
    if reference is not None:
        with torch.no_grad():
            same = torch.equal(y, reference(x))
        print(f"equal to the unpaged model, bit for bit: {same}")
        assert same
    pager.unwrap(model)


if __name__ == "__main__":
    main()
