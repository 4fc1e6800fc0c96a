"""Host memory across wrap, train and unwrap: does a process that wraps
models one after another (the benchmarks do) get its host memory back?
Prints, after each cycle, the process's resident memory, whether the pager
is still alive, and torch's pinned host cache.

    python -m benchmarks.host_memory [--cycles 2] [--layers 8]
"""

from __future__ import annotations

import argparse
import copy
import gc
import weakref

import torch

import pager
from benchmarks.bench_train import VOCAB, make_step
from benchmarks.harness import free_cuda, host_rss_gib
from benchmarks.models import Decoder


def host_cache() -> str:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return "n/a"
    s = stats()
    return (f"pinned cache: {s.get('reserved_bytes.current', 0) / 2**30:.2f} GiB reserved, "
            f"{s.get('allocated_bytes.current', 0) / 2**30:.2f} GiB allocated")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args(argv)
    ref = Decoder(n_layers=args.layers, d=2048, ff=5632, heads=16, vocab=VOCAB)
    state_bytes = 16 * sum(p.numel() for p in ref.parameters())
    ids = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    print(f"start: host RSS {host_rss_gib():.1f} GiB; model {state_bytes / 4 / 2**30:.1f} GiB fp32, "
          f"{state_bytes / 2**30:.1f} GiB with grads and AdamW state")
    for policy in ("keep", "offload", "recompute"):
        for cycle in range(args.cycles):
            model = copy.deepcopy(ref)
            pager.wrap(model, budget=int(0.5 * state_bytes), device="cuda", activations=policy)
            alive = weakref.ref(pager.of(model))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            step = make_step(model, opt, ids, ids)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            during = host_rss_gib()
            pager.unwrap(model)
            del model, opt, step
            free_cuda()
            gc.collect()
            print(f"{policy} cycle {cycle}: host RSS {during:.1f} GiB while training, {host_rss_gib():.1f} GiB after "
                  f"unwrap; pager alive after: {alive() is not None}; {host_cache()}")
            if alive() is not None:
                print("  referrers:", [type(r).__name__ for r in gc.get_referrers(alive())][:10])


if __name__ == "__main__":
    main()
