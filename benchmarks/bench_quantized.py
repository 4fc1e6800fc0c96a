"""Quantized weights streamed ([Note: wrapper-subclass weights] in
base/wrappers.py): the 7B-shaped bf16 decoder, its linear layers quantized
by torchao (int4 weight-only in tinygemm's packed layout, int8 weight-only),
streamed under a 2 GiB budget, against the same quantized model all on the
GPU and against the floor of the bytes it streams (at the pinned rate
measured in the same run); the bf16 model streamed beside them shows the
bytes saved. Forward of 1x512 tokens (link-bound) and of one token.

    python -m benchmarks.bench_quantized [--reps 5] [--layers 32] [--only int4]
"""

from __future__ import annotations

import argparse

import torch

import pager
from benchmarks.bench_compile import forward_ms
from benchmarks.harness import GiB, Row, environment, free_cuda, pinned_h2d_gbps, save
from benchmarks.models import build

BUDGET = 2 * GiB
SHAPES = {"fwd 1x512": (1, 512), "fwd 1x1": (1, 1)}


def configs():
    """(name, torchao config or None for bf16), or None with why torchao is missing."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError as e:
        return None, f"torchao is not installed ({e})"
    return [("bf16", None),
            ("int8 weight-only", Int8WeightOnlyConfig()),
            ("int4 weight-only", Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))], ""


def made(layers: int, config):
    """The decoder on the GPU with random weights, quantized by `config`."""
    model = build("cuda", n_layers=layers).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if config is not None:
        from torchao.quantization import quantize_

        quantize_(model, config)
    return model


def bench(args, rows, gbps):
    variants, why = configs()
    if variants is None:
        print("skipped:", why)
        rows.append(Row("7B-shaped quantized", "skipped", None, note=why))
        return
    for name, config in variants:
        if args.only and args.only not in name:
            continue
        try:
            model = made(args.layers, config)
        except Exception as e:  # (a quantization this torch/GPU lacks a kernel for: said, not hidden)
            rows.append(Row(f"{args.layers} layers {name}", "skipped", None, note=f"quantize_ failed: {e}"[:200]))
            print(rows[-1])
            free_cuda()
            continue
        xs = {w: torch.randn(*shape, 4096, device="cuda", dtype=torch.bfloat16) for w, shape in SHAPES.items()}
        gpu_ms = {w: forward_ms(model, x, args.reps) for w, x in xs.items()}
        torch.cuda.synchronize()
        pager.wrap(model, budget=BUDGET, device="cuda")
        pg = pager.of(model)
        total = pg.engine.total_bytes
        for w, x in xs.items():
            ms = forward_ms(model, x, args.reps)
            pg.reset()
            with torch.no_grad():
                model(x)
            torch.cuda.synchronize()
            stats = pg.stats()
            moved, stalled = stats.h2d_bytes, stats.stall_seconds * 1e3
            floor = moved / (gbps * 1e6)
            workload = f"{args.layers} layers {w}"
            rows.append(Row(workload, f"{name} all on GPU", gpu_ms[w], None, 1.0, "itself",
                            f"{total / GiB:.2f} GiB of pages"))
            rows.append(Row(workload, f"{name} pager 2 GiB", ms, None, ms / max(floor, 1e-9), "its floor",
                            f"{moved / 1e9:.2f} GB streamed, floor {floor:.1f} ms; {ms / gpu_ms[w]:.2f}x all on GPU; "
                            f"compute waited {stalled:.1f} ms for fetches"))
            print(rows[-2], rows[-1], sep="\n")
        pager.unwrap(model)
        del model, pg
        free_cuda()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--only", choices=["bf16", "int8", "int4"], help="one of the models")
    args = ap.parse_args(argv)
    env = environment()
    gbps = pinned_h2d_gbps()
    env["pinned_h2d_GBps"] = round(gbps, 1)
    rows: list[Row] = []
    bench(args, rows, gbps)
    save(rows, "quantized", env)


if __name__ == "__main__":
    main()
