"""What transparency costs: torch's clip_grad_norm_ and GradScaler in a
training step whose blocks do not fit the budget, and an on-demand access of a
paged-out block.

1. The ~1B fp32 decoder of bench_train (AdamW, 4x1024 tokens), budget 40% of
   the all-on-GPU peak. Steps: plain; + torch.nn.utils.clip_grad_norm_;
   fp16 autocast with GradScaler (unscale_, clip, step, update). Each on all
   on GPU and paged, interleaved, so the extra time of clip and GradScaler
   under pager is read against the same extra time all on GPU.
2. `layer.weight.sum()` on a block that was evicted: the time of the access
   (a synchronous fetch of the block) against the block's bytes.

    python -m benchmarks.bench_transparency [--reps 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import pager
from benchmarks.bench_train import VOCAB, cpu_copy, decoder_1b
from benchmarks.harness import GiB, Row, environment, event_ms, free_cuda, pinned_h2d_gbps, save


def make_step(model, opt, ids, tgt, variant, scaler):
    fp16 = variant.startswith("fp16")

    def step():
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
        if variant == "fp16 + GradScaler + clip":
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if variant == "fp32 + clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        opt.zero_grad()

    return step


# Each costed variant, and the variant it adds to.
VARIANTS = {"fp32": None, "fp32 + clip": "fp32", "fp16 autocast": None, "fp16 + GradScaler + clip": "fp16 autocast"}


def bench_steps(reps, rows):
    w = "1B decoder AdamW step 4x1024"
    ids = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    tgt = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    gpu = decoder_1b("cuda")
    cpu_ref = cpu_copy(decoder_1b, gpu)
    results = {}
    shared_rows = []
    for where in ("all on GPU", "pager"):
        model = gpu if where == "all on GPU" else copy.deepcopy(cpu_ref)
        if where == "pager":
            budget = int(0.4 * peak_gib * GiB)
            pager.wrap(model, budget=budget, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cuda")
        steps = {v: make_step(model, opt, ids, tgt, v, scaler) for v in VARIANTS}
        for v in VARIANTS:  # warm-up: state exists, summaries are being taken
            steps[v]()
            steps[v]()
        torch.cuda.synchronize()
        if where == "all on GPU":
            torch.cuda.reset_peak_memory_stats()
        times = {v: [] for v in VARIANTS}
        for _ in range(reps):  # interleaved, so drift hits every variant alike
            for v in VARIANTS:
                times[v].append(event_ms(steps[v]))
        if where == "all on GPU":
            peak_gib = torch.cuda.max_memory_allocated() / GiB
        results[where] = {v: statistics.median(t) for v, t in times.items()}
        note = ""
        if where == "pager":
            pager.of(model).reset()
            steps["fp32 + clip"]()
            clip_on_demand = pager.of(model).stats().on_demand
            pg = pager.of(model)
            pg.reset()
            steps["fp16 + GradScaler + clip"]()
            s = pg.stats()
            note = (f"budget {budget / GiB:.1f} GiB; a GradScaler step moved {s.h2d_bytes / 1e9:.1f} GB in, "
                    f"{s.d2h_bytes / 1e9:.1f} GB out; on-demand fetches: {s.on_demand} in a GradScaler step, "
                    f"{clip_on_demand} in a clipped one")
            # The shared mode (another Python thread exists: blocks in use stay
            # guarded, the step's operations pass the guard one by one). Sticky
            # per pager, so timed after the rest, fp32 and fp32 + clip in turns.
            pg.shared_mode = True  # as `note_threads` does when a second thread appears
            shared = {v: [] for v in ("fp32", "fp32 + clip")}
            for v in shared:
                steps[v]()
            for _ in range(reps):
                for v in shared:
                    shared[v].append(event_ms(steps[v]))
            for v, t in shared.items():
                ms = statistics.median(t)
                shared_rows.append(Row(w, f"pager, {v}, shared mode (timed after the others)", ms, None,
                                       ms / results["pager"][v], f"pager, {v}", ""))
            pager.unwrap(model)
        for v in VARIANTS:
            base = results["all on GPU"][v]
            rows.append(Row(w, f"{where}, {v}", results[where][v], None, results[where][v] / base,
                            f"all on GPU, {v}", note if v == "fp16 + GradScaler + clip" else ""))
            print(rows[-1])
        del model, opt, steps
        if where == "all on GPU":
            del gpu
        free_cuda()
    rows += shared_rows
    for row in shared_rows:
        print(row)
    for v, base in VARIANTS.items():
        if base is None:
            continue
        extra_pager = results["pager"][v] - results["pager"][base]
        extra_gpu = results["all on GPU"][v] - results["all on GPU"][base]
        rows.append(Row(w, f"'{v}' over '{base}': its extra cost under pager", extra_pager, None,
                        extra_pager / results["pager"][base], f"pager, {base} step",
                        f"all on GPU the same costs {extra_gpu:.1f} ms ({100 * extra_gpu / results['all on GPU'][base]:.1f}%)"))
        print(rows[-1])


def bench_on_demand(rows):
    from benchmarks.models import build

    model = build("cpu", n_layers=4)  # 7B-shaped bf16 layers, 405 MB each
    pager.wrap(model, budget=int(2.2 * sum(p.numel() * 2 for p in model.layers[0].parameters())), device="cuda")
    x = torch.randn(1, 16, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)
    pg = pager.of(model)
    weight = model.layers[0].up.weight
    block = pg.param_blocks[id(weight)]  # the layer, or its `up` part when layers are split
    times = []
    for _ in range(5):
        with pg.lock:
            if block in pg.resident and block.pins == 0:
                pg.engine.evict(block)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        weight.sum().item()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    nbytes = block.nbytes()
    rows.append(Row("on-demand access", f"layers[0].up.weight.sum() with its block {block.name!r} paged out "
                    f"({nbytes / 1e6:.0f} MB)",
                    ms, None, None, "", f"{nbytes / ms / 1e6:.1f} GB/s; link {pinned_h2d_gbps():.1f} GB/s"))
    print(rows[-1])
    pager.unwrap(model)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only-on-demand", action="store_true")
    args = ap.parse_args()
    rows: list[Row] = []
    env = environment()
    bench_on_demand(rows)
    if not args.only_on_demand:
        bench_steps(args.reps, rows)
    save(rows, "transparency", env)


if __name__ == "__main__":
    main()
