"""Embedding tables paged by rows ([Note: row tables] in pager/_rows.py).

1. Gather and write back 131,072 random rows of 128 fp32 (67 MB) of a pinned
   table: pager's path (a kernel reading the mapped host table; writes the
   same way), against one contiguous pinned copy of the same bytes (the
   link's floor), rows gathered by CPU threads into a pinned buffer and
   copied, and naive indexing.
2. Training a recommender-shaped model (an EmbeddingBag table, sparse
   gradients, and an MLP): the table row-paged under a budget against the same
   model with its table on the GPU (same batch, same rows touched), per step.
   With --table-gb above what fits on the GPU, the on-GPU row uses a table of
   --fit-gb with the same number of rows touched per batch.

    python -m benchmarks.bench_rows [--table-gb 40] [--fit-gb 4] [--budget 8GiB] [--optimizer sgd]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

import pager
from benchmarks.harness import GiB, Row, environment, free_cuda, save, time_ms

DIM = 128
ROWS_TOUCHED = 131072


class Recommender(nn.Module):
    def __init__(self, rows: int, hidden: int = 1024, table: torch.Tensor | None = None):
        super().__init__()
        self.table = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True, _weight=table)
        self.mlp = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, ids, offsets):
        return self.mlp(self.table(ids, offsets)).square().mean()


def big_table(rows: int) -> torch.Tensor:
    t = torch.empty(rows, DIM)
    t.uniform_(-0.01, 0.01)
    return t


def unique_rows(n_rows: int, k: int, device) -> torch.Tensor:
    rows = torch.randint(0, n_rows, (k + k // 8,), device=device).unique()
    return rows[torch.randperm(rows.numel(), device=device)[:k]]


def gather_scatter(rows_total: int) -> list[Row]:
    """Part 1, on a table of `rows_total` rows."""
    dev = torch.device("cuda")
    model = pager.wrap(nn.Sequential(nn.Embedding(rows_total, DIM, _weight=big_table(rows_total))),
                       budget="1GiB", rows=["0"], row_cache=0)
    table = pager.of(model).row_tables[0]
    rows = unique_rows(rows_total, ROWS_TOUCHED, dev)
    nbytes = rows.numel() * DIM * 4
    src = torch.randn(rows.numel(), DIM, device=dev)
    out = []
    floor_dst = torch.empty(nbytes // 4, device=dev)
    floor_ms = time_ms(lambda: floor_dst.copy_(table.host.view(-1)[: nbytes // 4], non_blocking=True), reps=20)
    out.append(Row("gather 131072x128 fp32", "contiguous pinned copy (floor)", floor_ms, ratio=1.0,
                   note=f"{nbytes / floor_ms / 1e6:.1f} GB/s"))
    ms = time_ms(lambda: table.gather(rows, ("weight",), insert=False), reps=20)
    out.append(Row("gather 131072x128 fp32", "pager (mapped host table)", ms, ratio=ms / floor_ms,
                   reference="floor", note=f"{nbytes / ms / 1e6:.1f} GB/s"))
    ms = time_ms(lambda: table.write(rows, {"weight": src}), reps=20)
    out.append(Row("write back 131072x128 fp32", "pager (mapped host table)", ms, ratio=ms / floor_ms,
                   reference="gather floor", note=f"{nbytes / ms / 1e6:.1f} GB/s; includes the host sync"))
    staging = torch.empty(rows.numel(), DIM, pin_memory=True)
    rows_cpu = rows.cpu()

    def staged():
        torch.index_select(table.host, 0, rows_cpu, out=staging)
        return staging.to(dev, non_blocking=True)

    ms = _wall_ms(staged)
    out.append(Row("gather 131072x128 fp32", f"CPU index_select ({torch.get_num_threads()} threads) + copy", ms,
                   ratio=ms / floor_ms, reference="floor"))
    ms = _wall_ms(lambda: table.host[rows_cpu].to(dev), reps=5)
    out.append(Row("gather 131072x128 fp32", "naive host[rows].to(cuda)", ms, ratio=ms / floor_ms, reference="floor"))
    pager.unwrap(model)
    return out


def _wall_ms(fn, warmup=2, reps=10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_optimizers(model, name: str):
    table = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
             "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01),
             "sparse_adam": lambda ps: torch.optim.SparseAdam(ps, lr=1e-3)}[name]
    return [table(list(model.table.parameters())), torch.optim.Adam(model.mlp.parameters(), lr=1e-3)]


def step_ms(model, opts, n_rows: int, bags: int, steps: int, warmup: int = 3) -> float:
    dev = torch.device("cuda")
    per_bag = ROWS_TOUCHED // bags
    batches = [(unique_rows(n_rows, ROWS_TOUCHED, dev), torch.arange(0, ROWS_TOUCHED, per_bag, device=dev))
               for _ in range(4)]
    times = []
    for i in range(warmup + steps):
        ids, offsets = batches[i % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids, offsets).backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def training(table_gb: float, fit_gb: float, budget: str, optimizer: str, bags: int, steps: int) -> list[Row]:
    dev = torch.device("cuda")
    out = []
    fit_rows = int(fit_gb * GiB) // (DIM * 4)
    torch.manual_seed(0)
    on_gpu = Recommender(fit_rows).to(dev)
    ref_ms = step_ms(on_gpu, make_optimizers(on_gpu, optimizer), fit_rows, bags, steps)
    peak = torch.cuda.max_memory_allocated() / GiB
    out.append(Row(f"train step, {ROWS_TOUCHED} rows x {DIM} fp32 touched, {optimizer}", f"table on GPU ({fit_gb:g} GB)",
                   ref_ms, peak_gib=peak, ratio=1.0))
    del on_gpu
    free_cuda()
    for gb in sorted({fit_gb, table_gb}):
        n_rows = int(gb * GiB) // (DIM * 4)
        t0 = time.perf_counter()
        model = Recommender(n_rows, table=big_table(n_rows))
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pager.wrap(model, budget=budget, rows=["table"])
        wrap_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        ms = step_ms(model, make_optimizers(model, optimizer), n_rows, bags, steps)
        s = pager.of(model).stats()
        out.append(Row(f"train step, {ROWS_TOUCHED} rows x {DIM} fp32 touched, {optimizer}",
                       f"row-paged table ({gb:g} GB), budget {budget}", ms,
                       peak_gib=torch.cuda.max_memory_allocated() / GiB, ratio=ms / ref_ms, reference="table on GPU",
                       note=f"cache hits {s.row_hits}, misses {s.row_misses}; build {build_s:.0f} s, wrap {wrap_s:.0f} s"))
        pager.unwrap(model)
        del model
        free_cuda()
    return out


def speedtorch_row() -> list[Row]:
    try:
        import SpeedTorch  # noqa: F401
    except ImportError:
        return [Row("gather 131072x128 fp32", "SpeedTorch", None, note="not installed: skipped")]
    return [Row("gather 131072x128 fp32", "SpeedTorch", None, note="installed but not benchmarked here")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table-gb", type=float, default=40.0)
    ap.add_argument("--fit-gb", type=float, default=4.0)
    ap.add_argument("--gather-gb", type=float, default=4.0)
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adagrad", "sparse_adam"])
    ap.add_argument("--bags", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-gather", action="store_true")
    args = ap.parse_args()
    env = environment()
    rows = [] if args.skip_gather else gather_scatter(int(args.gather_gb * GiB) // (DIM * 4)) + speedtorch_row()
    rows += training(args.table_gb, args.fit_gb, args.budget, args.optimizer, args.bags, args.steps)
    save(rows, f"rows_{args.optimizer}_{args.table_gb:g}gb", env)


if __name__ == "__main__":
    main()
