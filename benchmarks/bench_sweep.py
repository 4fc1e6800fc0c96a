"""Time of the 7B-shaped forward against the budget, for pager and the peers
that take a budget (accelerate `dispatch_model` with the first k layers on
the GPU), with the budget-less peers (accelerate `cpu_offload`, diffusers
group offloading) as lines. Writes sweep.json; benchmarks/plot.py draws it.

    python -m benchmarks.bench_sweep [--layers 16] [--peers accelerate,diffusers]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import pager
from benchmarks.harness import environment, free_cuda, out_path, pinned_h2d_gbps, time_ms
from benchmarks.models import build, layer_bytes


def fwd_of(model, x):
    def fwd():
        with torch.no_grad():
            model(x)

    return fwd


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--peers", default="accelerate,diffusers")
    args = ap.parse_args(argv)
    env = environment()
    bw = pinned_h2d_gbps()
    gpu = build("cuda", n_layers=args.layers).eval()
    per_layer = layer_bytes(gpu)
    x = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    out = {"env": env, "pinned_h2d_GBps": bw, "layer_bytes": per_layer, "layers": args.layers,
           "all_on_gpu_ms": time_ms(fwd_of(gpu, x), reps=20), "series": {}, "lines": {}}
    cpu = build("meta", n_layers=args.layers).to_empty(device="cpu").eval()
    cpu.load_state_dict(gpu.state_dict())
    del gpu
    free_cuda()
    ks = [2, 3, 4, 6, 8, 10, 12, 14, args.layers]
    slack = 64 << 20

    paged = copy.deepcopy(cpu)
    for label, blocks in (("pager", None), ("pager, blocks=nn.Linear", lambda n, m: isinstance(m, torch.nn.Linear))):
        pager.wrap(paged, budget="20GiB", device="cuda", blocks=blocks)
        series = []
        for k in ks:
            pager.of(paged).set_budget(k * per_layer + slack)
            f = fwd_of(paged, x)
            f()
            series.append((k, time_ms(f, reps=5)))
            print(label, k, series[-1][1], flush=True)
        out["series"][label] = series
        pager.unwrap(paged)
        free_cuda()

    if "accelerate" in args.peers:
        try:
            from accelerate import cpu_offload, dispatch_model

            series = []
            for k in ks[:-1]:
                model = copy.deepcopy(cpu)
                device_map = {f"layers.{i}": (0 if i < k else "cpu") for i in range(args.layers)}
                device_map["norm"] = 0
                dispatch_model(model, device_map=device_map, main_device=0)
                series.append((k, time_ms(fwd_of(model, x), warmup=1, reps=3)))
                print("dispatch_model", k, series[-1][1], flush=True)
                del model
                free_cuda()
            out["series"]["accelerate dispatch_model"] = series
            model = copy.deepcopy(cpu)
            cpu_offload(model, execution_device=torch.device("cuda", 0))
            out["lines"]["accelerate cpu_offload"] = time_ms(fwd_of(model, x), warmup=1, reps=3)
            del model
            free_cuda()
        except ImportError:
            out["lines"]["accelerate (not installed)"] = None
    if "diffusers" in args.peers:
        for label, kw in (("diffusers group offload (leaf, stream)", dict(offload_type="leaf_level", use_stream=True)),
                          ("diffusers group offload (block, stream)", dict(offload_type="block_level", num_blocks_per_group=1, use_stream=True))):
            try:
                from diffusers.hooks import apply_group_offloading

                model = copy.deepcopy(cpu)
                apply_group_offloading(model, onload_device=torch.device("cuda"), **kw)
                out["lines"][label] = time_ms(fwd_of(model, x), warmup=2, reps=5)
                print(label, out["lines"][label], flush=True)
                del model
            except ImportError:
                out["lines"][label + " (not installed)"] = None
            except Exception as e:
                print(label, "failed:", type(e).__name__, str(e)[:200])
                out["lines"][label + f" (failed: {type(e).__name__})"] = None
            free_cuda()
    path = out_path("sweep.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
