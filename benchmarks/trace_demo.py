"""Write a pager trace of two 7B-shaped forwards under a budget of 2 layers.

    python -m benchmarks.trace_demo trace.json [--tokens 4096]
"""

from __future__ import annotations

import argparse

import torch

import pager
from benchmarks.models import build, layer_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    model = build("meta", n_layers=args.layers).to_empty(device="cpu").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    pager.wrap(model, budget=2 * layer_bytes(model) + (64 << 20), device="cuda", trace_steps=2)
    x = torch.randn(1, args.tokens, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(4):
            model(x)
    torch.cuda.synchronize()
    pg = pager.of(model)
    pg.trace(args.path)
    print(pg.report())


if __name__ == "__main__":
    main()
