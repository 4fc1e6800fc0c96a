"""Where torch's clip_grad_norm_ costs a paged training step (issue 71, item 3).

The bench_budget model (a ~953M fp32 Llama-shaped LlamaForCausalLM, 4x1024,
AdamW) at one budget share, defaults. One wrapped model runs, in order:
steps without clip, steps with torch's clip, then one step of each timed by
phase (forward, backward, clip, step; a device sync after each), then one
step of each under torch.profiler (traces written, summarized by
`benchmarks.profile_summary`). The same for the model all on the GPU.
Per step: seconds, pager's on-demand fetches, bytes each way.

    python -m benchmarks.profile_clip --out DIR [--share 0.4] [--steps 6] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

import pager
from benchmarks.bench_budget import QUICK, STATE_BYTES_PER_PARAM, build_model, environment, llama_config
from benchmarks.harness import GiB, free_cuda


def step(model, opt, x, clip: bool, phases: dict | None = None):
    def mark(name):
        if phases is not None:
            torch.cuda.synchronize()
            phases[name] = time.perf_counter()

    mark("start")
    loss = model(input_ids=x, labels=x).loss
    mark("forward")
    loss.backward()
    mark("backward")
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    mark("clip")
    opt.step()
    mark("step")
    opt.zero_grad()
    mark("zero")
    return float(loss.detach())


def run(name, model, opt, x, steps: int, out: str, paged: bool) -> dict:
    pg = pager.of(model) if paged else None
    rec: dict = {"name": name, "steps": {}}
    for clip in (False, True):
        times = []
        for _ in range(steps):
            if pg is not None:
                pg.reset()
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = step(model, opt, x, clip)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            extra = ""
            if pg is not None:
                s = pg.stats()
                extra = (
                    f" misses {s.misses}, deferred {s.deferred_steps}, host steps {s.host_steps} "
                    f"({s.host_step_seconds * 1e3:.0f} ms, waited {s.host_step_wait_seconds * 1e3:.0f} ms), h2d {s.h2d_bytes / GiB:.2f} GiB, "
                    f"d2h {s.d2h_bytes / GiB:.2f} GiB, policy {s.activations_policy}"
                )
            print(f"  {name} clip={clip}: {times[-1]:.3f} s loss {loss:.4f}{extra}", flush=True)
        rec["steps"][str(clip)] = times
        phases: dict = {}
        step(model, opt, x, clip, phases)
        keys = list(phases)
        rec[f"phases_clip_{clip}"] = {b: phases[b] - phases[a] for a, b in zip(keys, keys[1:])}
        print(
            f"  {name} clip={clip} phases: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rec[f"phases_clip_{clip}"].items()),
            flush=True,
        )
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(model, opt, x, clip)
            torch.cuda.synchronize()
        path = os.path.join(out, f"clip_{name.split()[0]}_{clip}.json.gz")
        prof.export_chrome_trace(path)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        with open(os.path.join(out, f"clip_{name.split()[0]}_{clip}_ops.txt"), "w") as f:
            f.write(table)
    med = {k: statistics.median(v[2:] or v) for k, v in rec["steps"].items()}
    rec["median"] = med
    print(
        f"  {name}: median without clip {med['False']:.3f} s, with {med['True']:.3f} s: {med['True'] / med['False']:.3f}x",
        flush=True,
    )
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--share", type=float, default=0.4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help=f"a smoke run ({QUICK})")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = environment("cuda")
    print(env, flush=True)
    cfg = llama_config(args.quick, 1024)
    ref = build_model(cfg, 0)
    n = sum(q.numel() for q in ref.parameters())
    x = torch.randint(0, cfg.vocab_size, (4, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    result = {"env": env, "args": vars(args), "runs": []}

    model = copy.deepcopy(ref).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    result["runs"].append(run("gpu all", model, opt, x, args.steps, args.out, paged=False))
    del model, opt
    free_cuda()

    budget = int(args.share * STATE_BYTES_PER_PARAM * n)
    model = copy.deepcopy(ref)
    pager.wrap(model, budget=budget)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    print(f"pager budget {budget / GiB:.2f} GiB", flush=True)
    result["runs"].append(run("pager", model, opt, x, args.steps, args.out, paged=True))
    with open(os.path.join(args.out, "profile_clip.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
