"""Host memory of ranks serving one model, with and without one shared host
copy per node (`wrap(share_host_pages=True)`).

Each rank wraps the same bf16 decoder under its own budget and runs forwards
of its own batches; rank 0 reports each rank's proportional set size (PSS:
shared pages counted once across the processes that map them) after wrap and
after the forwards, and the forward time. With more ranks than GPUs (one
GPU), the ranks share it through gloo: the memory figures hold, the times are
of ranks sharing one link.

    torchrun --nproc-per-node 2 -m benchmarks.bench_share --share 0
    torchrun --nproc-per-node 2 -m benchmarks.bench_share --share 1
"""

from __future__ import annotations

import argparse
import os

import psutil
import torch
import torch.distributed as dist

import pager
from benchmarks.harness import GiB, Row, environment, save, time_ms
from benchmarks.models import build


def pss_gib() -> float:
    return psutil.Process().memory_full_info().pss / GiB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--share", type=int, default=1)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local % gpus)
    dist.init_process_group("nccl" if gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)) else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    before = pss_gib()  # (the model's own tensors are freed as wrap moves them into pages)
    model = build("cpu", n_layers=args.layers)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / GiB
    pager.wrap(model, budget=f"{args.budget_gib}GiB", share_host_pages=bool(args.share))
    after_wrap = pss_gib() - before
    x = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            model(x)

    ms = time_ms(forward, warmup=1, reps=args.reps)
    after_run = pss_gib() - before
    rows = [None] * world
    dist.all_gather_object(rows, (rank, after_wrap, after_run, ms))
    if rank == 0:
        label = "one shared host copy per node" if args.share else "a host copy per rank"
        out = []
        for r, wrap_gib, run_gib, t in rows:
            out.append(Row(f"{args.layers}-layer 7B-shaped bf16 decoder ({weights_gib:.1f} GiB), {world} ranks, "
                           f"budget {args.budget_gib} GiB each", f"rank {r}: {label}", t,
                           note=f"PSS {wrap_gib:.2f} GiB over the start at wrap, {run_gib:.2f} GiB after the forwards; "
                                f"{sum(w for _r, w, _u, _t in rows):.2f} GiB for all ranks at wrap"))
        save(out, f"bench_share_{args.share}", environment())
    dist.barrier()
    pager.unwrap(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
