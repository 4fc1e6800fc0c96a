"""Run a decoder whose weights are larger than the device budget.

On a GPU: a 7B-shaped bf16 decoder stack (16 layers, 6.5 GB) under a 2 GiB
budget. Without one: a small fp32 decoder on the CPU device (host memory
stands for device memory), same paging code, checked against the unpaged model.

    python examples/run_big_model.py [--budget 2GiB] [--layers 16] [--split-fetch all]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import pager  # noqa: E402
from benchmarks.models import build, layer_bytes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    cuda = torch.cuda.is_available()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", default="2GiB" if cuda else None)
    ap.add_argument("--compress", choices=["lossless", "fp8", "int4"], default=None,
                    help="weights compressed in their host pages, decoded on the device (bf16 models; on the CPU "
                         "the example's model is bf16 then)")
    ap.add_argument("--split-fetch", default=None,
                    help='other GPUs whose links carry a share of every fetch: "all" or "cuda:1,cuda:2" '
                         '(docs/split-fetch.md)')
    args = ap.parse_args()
    split = args.split_fetch if args.split_fetch in (None, "all") else args.split_fetch.split(",")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if cuda:
        device, dims, dtype = "cuda", {}, torch.bfloat16
        x = torch.randn(1, 512, 4096, device=device, dtype=dtype)
        model = build("meta", n_layers=args.layers).to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        reference = None
    else:
        device, dims = "cpu", {"d": 256, "ff": 688, "heads": 4}
        dtype = torch.bfloat16 if args.compress else torch.float32
        x = torch.randn(2, 64, 256, dtype=dtype)
        model = build("cpu", dtype=dtype, n_layers=args.layers, **dims).eval()
        reference = copy.deepcopy(model)

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = args.budget or 3 * layer_bytes(model)
    pager.wrap(model, budget=budget, device=device, compress=args.compress, split_fetch=split)
    pg = pager.of(model)
    if reference is not None and args.compress in ("fp8", "int4"):
        reference.load_state_dict(model.state_dict())  # lossy: the model computes with the decoded weights
    print(f"model: {len(pg.blocks)} blocks, {pager.format_bytes(weights)} of weights; budget {pager.format_bytes(pg.budget_bytes)} on {device}")

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
