"""Train a ProxylessNAS-style supernet under a budget of about a quarter of
its weights plus Adam state: one path sampled per step, said in advance with
`expect()` so its blocks are prefetched; candidates off the path are neither
fetched nor stepped.

On a GPU: 24 layers (d=1024, candidates of width 2/4/6/8 x d), 4.4 GiB of
weights, 13 GiB with Adam state, under a 3.3 GiB budget. Without one: a small
supernet on the CPU device, checked bit for bit against unpaged training.

    python examples/nas_supernet.py [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import pager  # noqa: E402
from benchmarks.models import SuperNet  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    if cuda:
        device, size, batch = "cuda", dict(n_layers=24, d=1024, heads=16, vocab=32000), (8, 1024)
    else:
        device, size, batch = "cpu", dict(n_layers=8, d=64, heads=4, vocab=256), (4, 32)
    net = SuperNet(**size)
    reference = None if cuda else copy.deepcopy(net)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    budget = int(0.25 * 3 * weights)  # a quarter of weights + Adam's two moments

    pager.wrap(net, budget=budget, device=device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3) if reference is not None else None
    pg = pager.of(net)
    print(f"supernet: {pager.format_bytes(weights)} weights, {pager.format_bytes(4 * weights)} with grads and Adam; "
          f"budget {pager.format_bytes(budget)}; {len(pg.blocks)} blocks")

    rng = random.Random(0)
    n_cand = len(net.layers[0].candidates)
    t0 = time.perf_counter()
    for step in range(args.steps):
        ids = torch.randint(0, size["vocab"], batch, device=device)
        path = [rng.randrange(n_cand) for _ in net.layers]
        net.set_path(path)
        pg.expect(net.path_modules(path))  # the sampled path is known before forward
        loss = F.cross_entropy(net(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if reference is not None:
            reference.set_path(path)
            ref_loss = F.cross_entropy(reference(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert torch.equal(loss, ref_loss), (step, loss, ref_loss)
        if step % 5 == 4:
            if cuda:
                torch.cuda.synchronize()
            print(f"step {step + 1}: loss {loss.item():.3f}, {1e3 * (time.perf_counter() - t0) / 5:.0f} ms/step")
            t0 = time.perf_counter()
    s = pg.stats()
    print(s)
    assert s.peak_resident_bytes <= budget
    if reference is not None:
        print("losses equal to unpaged training at every step, bit for bit: True")
    pager.unwrap(net)


if __name__ == "__main__":
    main()
