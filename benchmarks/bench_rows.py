"""Embedding tables paged by rows ([Note: row tables] in rows/table.py).

1. Gather and write back 131,072 random rows of 128 fp32 (67 MB), sorted as a
   lookup reads them, of a pinned table of each --gather-gb: pager's read (the
   learned split between a kernel on the mapped table and CPU threads with a
   copy, [Note: two paths for scattered rows]) and each path alone, its write
   back, against one contiguous pinned copy of the same bytes (the link's
   floor), naive indexing, and SpeedTorch (a pinned cupy table; needs cupy).
2. Training a recommender-shaped model (an EmbeddingBag table, sparse
   gradients, and an MLP): the table row-paged under a budget, without and
   with `expect_rows` of the next batch, against the same model with its table
   on the GPU (same batch, same rows touched), and SpeedTorch's loop (SGD).
   With --table-gb above what fits on the GPU, the on-GPU row uses a table of
   --fit-gb with the same number of rows touched per batch. A new batch every
   step, measured once the cache is full (each row it takes in puts one out,
   written back if changed); --skew draws power-law rows instead of distinct
   random ones. A last row cycles 4 batches, which the cache then holds: the
   step's cost with nothing crossing the link. A step's time is that of a
   training loop (runs of --steps steps, synchronized before and after each
   run only: samples/s); the note gives one step synchronized before and after
   (which leaves nothing of one step to overlap the next). --hidden sets the
   dense layers' width, so the device's own work a step (1024: about 2 ms on
   the H100, 4096: about 18 ms) against the host's and the link's part of a
   row-paged step.

    python -m benchmarks.bench_rows [--table-gb 40] [--fit-gb 4] [--gather-gb 4 40] [--budget 8GiB] [--optimizer sgd]
                                    [--skew 1.5] [--hidden 4096]
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


def batch_ids(n_rows: int, skew: float, device) -> torch.Tensor:
    """ROWS_TOUCHED lookups of a table of `n_rows`: distinct random rows
    (skew 0: a row comes back only by chance), or rows drawn by a power law
    (skew s > 0: rank n_rows * u**(1 + s), scattered over the table by a
    multiplicative hash; repeats included, as a recommender's batch has)."""
    if skew == 0:
        return unique_rows(n_rows, ROWS_TOUCHED, device)
    u = torch.rand(ROWS_TOUCHED, device=device, dtype=torch.float64)
    rank = (u ** (1 + skew) * n_rows).long()
    return (rank * 2654435761) % n_rows


def gather_scatter(gb: float) -> list[Row]:
    """Part 1, on a table of `gb` GB: the rows sorted, as a lookup reads them."""
    dev = torch.device("cuda")
    rows_total = int(gb * GiB) // (DIM * 4)
    model = pager.wrap(nn.Sequential(nn.Embedding(rows_total, DIM, _weight=big_table(rows_total))),
                       budget="1GiB", rows=["0"], row_cache=0)
    table = pager.of(model).row_tables[0]
    reader = table.readers["weight"]
    rows = unique_rows(rows_total, ROWS_TOUCHED, dev).sort().values
    nbytes = rows.numel() * DIM * 4
    src = torch.randn(rows.numel(), DIM, device=dev)
    what = f"gather 131072x128 fp32, {gb:g} GB table"
    out = []
    floor_dst = torch.empty(nbytes // 4, device=dev)
    floor_ms = time_ms(lambda: floor_dst.copy_(table.host.view(-1)[: nbytes // 4], non_blocking=True), reps=20)
    out.append(Row(what, "contiguous pinned copy (floor)", floor_ms, ratio=1.0, note=f"{nbytes / floor_ms / 1e6:.1f} GB/s"))
    for label, share in (("pager (learned)", None), ("kernel on the mapped table alone", 1.0),
                         ("CPU threads + copy alone", 0.0)):
        reader.learn, reader.mapped_share = (True, 0.5) if share is None else (False, share)
        ms = _wall_ms(lambda: reader.read(rows), warmup=6, reps=20)
        note = f"{nbytes / ms / 1e6:.1f} GB/s" + (f"; {_learned(reader)}" if share is None else "")
        out.append(Row(what, label, ms, ratio=ms / floor_ms, reference="floor", note=note))
    ms = _wall_ms(lambda: table._write_host(rows, {"weight": src}), reps=20)
    out.append(Row(what.replace("gather", "write back"), "pager (kernel on the mapped table)", ms, ratio=ms / floor_ms,
                   reference="gather floor", note=f"{nbytes / ms / 1e6:.1f} GB/s"))
    rows_cpu = rows.cpu()
    ms = _wall_ms(lambda: table.host[rows_cpu].to(dev), reps=5)
    out.append(Row(what, "naive host[rows].to(cuda)", ms, ratio=ms / floor_ms, reference="floor"))
    pager.unwrap(model)
    del model
    out += speedtorch_gather(rows_total, rows, what, floor_ms)
    return out


def _learned(reader) -> str:
    kernel_s, split_s = reader.row_seconds["kernel"], reader.row_seconds["split"]
    way = "split" if kernel_s and split_s and split_s < kernel_s else "kernel alone"
    return f"learned: {way} (split share {reader.mapped_share:.2f})"


def _speedtorch():
    try:
        import SpeedTorch
        return SpeedTorch
    except ImportError as e:  # (it needs cupy)
        return str(e)


def speedtorch_gather(rows_total: int, rows: torch.Tensor, what: str, floor_ms: float) -> list[Row]:
    """SpeedTorch's recipe: a cupy array in pinned host memory, indexed on the device (ModelFactory, CPUPinn=True)."""
    st = _speedtorch()
    if isinstance(st, str):
        return [Row(what, "SpeedTorch", None, note=f"not installed ({st}): skipped")]
    holder = nn.Embedding(1, DIM).cuda()
    factory = st.ModelFactory(holder, rows_total, DIM, CPUPinn=True)
    factory.zerosInit()
    rows_np = rows.cpu().numpy()
    ms = _wall_ms(lambda: factory.beforeForwardPass(rows_np), reps=20)
    back_ms = _wall_ms(lambda: factory.afterOptimizerStep(rows_np), reps=20)
    del factory
    return [Row(what, "SpeedTorch ModelFactory(CPUPinn=True).beforeForwardPass", ms, ratio=ms / floor_ms,
                reference="floor", note=f"{rows.numel() * DIM * 4 / ms / 1e6:.1f} GB/s"),
            Row(what.replace("gather", "write back"), "SpeedTorch afterOptimizerStep", back_ms, ratio=back_ms / floor_ms,
                reference="gather floor")]


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


def step_ms(model, opts, n_rows: int, bags: int, steps: int, skew: float, warmup: int = 3, ahead=None,
            around=None, cycle: int = 0, windows: int = 3) -> tuple[float, float]:
    """(ms a step as a training loop runs them: the median over `windows` runs
    of `steps` steps, synchronized before and after each run only, which is
    what samples/s measures; ms of one step synchronized before and after,
    the median of `steps`). `ahead(next_ids)` runs after the forward
    (pager's expect_rows); `around(ids)` wraps the step (SpeedTorch's
    before/after calls) and returns the ids the model looks up. `cycle` > 0:
    that many batches, over and over (a cache that holds them serves every row)."""
    dev = torch.device("cuda")
    per_bag = ROWS_TOUCHED // bags
    # A new batch every step (skew 0: no row comes back but by chance, the device cache cannot help).
    batches = [(batch_ids(n_rows, skew, dev), torch.arange(0, ROWS_TOUCHED, per_bag, device=dev))
               for _ in range(cycle or warmup + (windows + 1) * steps + 1)]
    at = 0

    def one_step():
        nonlocal at
        ids, offsets = batches[at % len(batches)]
        at += 1
        finish = None
        if around is not None:
            ids, finish = around(ids)
        loss = model(ids, offsets)
        if ahead is not None:
            ahead(batches[at % len(batches)][0])
        loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        if finish is not None:
            finish()

    for _ in range(warmup):
        one_step()
    runs, synced = [], []
    for _ in range(windows):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1e3 / steps)
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one_step()
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs), statistics.median(synced)


def training(table_gb: float, fit_gb: float, budget: str, optimizer: str, bags: int, steps: int,
             skew: float, hidden: int) -> list[Row]:
    dev = torch.device("cuda")
    out = []
    drawn = "distinct random rows" if skew == 0 else f"power-law rows (skew {skew:g})"
    what = f"train step, {ROWS_TOUCHED} lookups of {drawn} x {DIM} fp32, {optimizer}, layers {hidden} wide"
    fit_rows = int(fit_gb * GiB) // (DIM * 4)
    torch.manual_seed(0)
    on_gpu = Recommender(fit_rows, hidden).to(dev)
    ref_ms, ref_synced = step_ms(on_gpu, make_optimizers(on_gpu, optimizer), fit_rows, bags, steps, skew)
    peak = torch.cuda.max_memory_allocated() / GiB
    out.append(Row(what, f"table on GPU ({fit_gb:g} GB)", ref_ms, peak_gib=peak, ratio=1.0,
                   note=f"one step synchronized: {ref_synced:.2f} ms"))

    def synced_note(synced: float) -> str:
        return f"one step synchronized: {synced:.2f} ms ({synced / ref_synced:.2f}x)"

    del on_gpu
    free_cuda()
    for gb in sorted({fit_gb, table_gb}):
        n_rows = int(gb * GiB) // (DIM * 4)
        t0 = time.perf_counter()
        model = Recommender(n_rows, hidden, table=big_table(n_rows))
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pager.wrap(model, budget=budget, rows=["table"])
        wrap_s = time.perf_counter() - t0
        opts = make_optimizers(model, optimizer)
        p = pager.of(model)
        # Warm up until the cache is full: in the steady state every row it takes in puts one out.
        warmup = 3 + 2 * p.row_tables[0].cache.capacity // ROWS_TOUCHED
        for label, ahead in (("", None), (", expect_rows", lambda ids: p.expect_rows(model.table, ids))):
            step_ms(model, opts, n_rows, bags, 1, skew, warmup=warmup, ahead=ahead, windows=1)  # (the warm-up)
            p.reset()
            torch.cuda.reset_peak_memory_stats()
            ms, synced = step_ms(model, opts, n_rows, bags, steps, skew, ahead=ahead)
            s = p.stats()
            out.append(Row(what, f"row-paged table ({gb:g} GB), budget {budget}{label}", ms,
                           peak_gib=torch.cuda.max_memory_allocated() / GiB, ratio=ms / ref_ms, reference="table on GPU",
                           note=f"{synced_note(synced)}; "
                                f"cache hits {s.row_hits}, misses {s.row_misses} ({s.row_ahead_hits} read ahead), "
                                f"{s.row_d2h_bytes / (3 + 4 * steps) / 1e6:.0f} MB written back a step; "
                                f"{_learned(p.row_tables[0].readers['weight'])}; "
                                f"build {build_s:.0f} s, wrap {wrap_s:.0f} s"))
        # The host's part of a step: every row in the cache, nothing crosses the link.
        p.reset()
        ms, synced = step_ms(model, opts, n_rows, bags, steps, skew, cycle=4)
        s = p.stats()
        out.append(Row(what, f"row-paged table ({gb:g} GB), 4 batches cycled: every row cached", ms,
                       ratio=ms / ref_ms, reference="table on GPU",
                       note=f"{synced_note(synced)}; cache hits {s.row_hits}, misses {s.row_misses} (the first pass)"))
        pager.unwrap(model)
        del model, opts
        free_cuda()
        if optimizer == "sgd":
            out += speedtorch_training(gb, n_rows, bags, steps, skew, hidden, what, ref_ms, synced_note)
    return out


def speedtorch_training(gb: float, n_rows: int, bags: int, steps: int, skew: float, hidden: int, what: str,
                        ref_ms: float, synced_note) -> list[Row]:
    """SpeedTorch's loop: the batch's rows become the weight of a batch-sized table
    on the GPU (beforeForwardPass), SGD updates it, afterOptimizerStep writes it back."""
    st = _speedtorch()
    label = f"SpeedTorch ({gb:g} GB pinned cupy table)"
    if isinstance(st, str):
        return [Row(what, label, None, note=f"not installed ({st}): skipped")]
    dev = torch.device("cuda")
    model = Recommender(ROWS_TOUCHED, hidden).to(dev)
    factory = st.ModelFactory(model.table, n_rows, DIM, CPUPinn=True)
    factory.zerosInit()
    positions = torch.arange(ROWS_TOUCHED, device=dev)

    def around(ids):
        rows_np = ids.cpu().numpy()  # (SpeedTorch takes numpy indices)
        factory.beforeForwardPass(rows_np)
        return positions, lambda: factory.afterOptimizerStep(rows_np)

    ms, synced = step_ms(model, make_optimizers(model, "sgd"), n_rows, bags, steps, skew, around=around)
    del factory, model
    free_cuda()
    return [Row(what, label, ms, ratio=ms / ref_ms, reference="table on GPU", note=synced_note(synced))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table-gb", type=float, default=40.0)
    ap.add_argument("--fit-gb", type=float, default=4.0)
    ap.add_argument("--gather-gb", type=float, nargs="+", default=[4.0, 40.0])
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adagrad", "sparse_adam"])
    ap.add_argument("--bags", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skew", type=float, default=0.0, help="0: distinct random rows a step; s > 0: power-law rows")
    ap.add_argument("--hidden", type=int, default=1024,
                    help="width of the dense layers: the device's work a step beside the table's")
    ap.add_argument("--skip-gather", action="store_true")
    ap.add_argument("--skip-training", action="store_true")
    args = ap.parse_args()
    env = environment()
    rows = [] if args.skip_gather else [r for gb in args.gather_gb for r in gather_scatter(gb)]
    if not args.skip_training:
        rows += training(args.table_gb, args.fit_gb, args.budget, args.optimizer, args.bags, args.steps, args.skew,
                         args.hidden)
    skew = f"_skew{args.skew:g}" if args.skew else ""
    wide = f"_h{args.hidden}" if args.hidden != 1024 else ""
    save(rows, f"rows_{args.optimizer}_{args.table_gb:g}gb{skew}{wide}{'_gather' if args.skip_training else ''}", env)


if __name__ == "__main__":
    main()
