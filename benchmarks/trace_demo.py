"""Write a pager trace of two 7B-shaped forwards under a budget (2 layers by default).

    python -m benchmarks.trace_demo trace.json [--tokens 4096] [--budget-layers 2] [--linear]
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
    ap.add_argument("--budget-layers", type=int, default=2)
    ap.add_argument("--linear", action="store_true", help="every nn.Linear a block")
    args = ap.parse_args()
    model = build("meta", n_layers=args.layers).to_empty(device="cpu").eval()
    model.load_state_dict(build("cuda", n_layers=args.layers).state_dict())  # random weights, made fast
    blocks = (lambda name, m: isinstance(m, torch.nn.Linear)) if args.linear else None
    budget = args.budget_layers * layer_bytes(model) + (64 << 20)
    pager.wrap(model, budget=budget, device="cuda", trace_steps=2, blocks=blocks)
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
