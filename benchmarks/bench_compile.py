"""pager under torch.compile ([Note: pager under torch.compile] in
model/hooks.py): the 7B-shaped bf16 decoder's forward (16 layers) and the
~1B fp32 decoder's AdamW step, eager and compiled (inductor, each layer
compiled by itself, as FSDP2 does), paged and all on the GPU, in one run.

1. Forward, 8x2048 tokens (compute-bound), budget half the layers: compiled
   paged against compiled all on the GPU.
2. Forward, 1x512 tokens (link-bound), budget 2 layers: compiled paged
   against its floor (the bytes it streams at the pinned rate).
3. Training step of the 1B decoder, 4x1024 tokens, budget 40% of weights,
   gradients and AdamW state: compiled paged against eager paged.

    python -m benchmarks.bench_compile [--reps 5]
"""

from __future__ import annotations

import argparse
import copy

import torch

import pager
from benchmarks.bench_train import make_step, measure
from benchmarks.harness import GiB, Row, environment, free_cuda, pinned_h2d_gbps, save, time_ms
from benchmarks.models import Decoder, build, layer_bytes

VOCAB = 32000


def compile_layers(model):
    for layer in model.layers:
        layer.compile()
    return model


def forward_ms(model, x, reps):
    def fwd():
        with torch.no_grad():
            model(x)

    fwd()
    return time_ms(fwd, warmup=2, reps=reps)


def bench_forward(args, rows, gbps):
    cpu = build("meta", n_layers=16).to_empty(device="cpu")
    with torch.no_grad():
        for p in cpu.parameters():
            p.normal_(0, 0.02)
    per_layer = layer_bytes(cpu)
    for w, shape, budget_layers in (("compute-bound fwd 8x2048", (8, 2048), 8), ("link-bound fwd 1x512", (1, 512), 2)):
        x = torch.randn(*shape, 4096, device="cuda", dtype=torch.bfloat16)
        results = {}
        for compiled in (False, True):
            torch._dynamo.reset()
            gpu = copy.deepcopy(cpu).to("cuda").eval()
            if compiled:
                compile_layers(gpu)
            results[("gpu", compiled)] = forward_ms(gpu, x, args.reps)
            del gpu
            free_cuda()
            m = copy.deepcopy(cpu).eval()
            if compiled:
                compile_layers(m)
            pager.wrap(m, budget=budget_layers * per_layer + (256 << 20), device="cuda")
            ms = forward_ms(m, x, args.reps)
            pg = pager.of(m)
            pg.reset()
            with torch.no_grad():
                m(x)
            torch.cuda.synchronize()
            # (the shared mode: another thread counted as a user of the tensors, base/threads.py)
            results[("pager", compiled)] = (ms, pg.stats().h2d_bytes, pg.shared_mode)
            pager.unwrap(m)
            del m
            free_cuda()
        for compiled in (False, True):
            label = "compiled" if compiled else "eager"
            gpu_ms = results[("gpu", compiled)]
            ms, moved, shared = results[("pager", compiled)]
            floor = moved / (gbps * 1e6)
            rows.append(Row(w, f"all on GPU, {label}", gpu_ms, None, 1.0, "itself"))
            rows.append(Row(w, f"pager {budget_layers} layers, {label}", ms, None, ms / gpu_ms,
                            f"all on GPU, {label}", f"{ms / max(floor, 1e-9):.2f}x the floor of the "
                            f"{moved / 1e9:.2f} GB it streams; shared mode {shared}"))
            print(rows[-2], rows[-1], sep="\n")


def bench_train(args, rows):
    w = "1B decoder AdamW step 4x1024, budget 40%"
    ids = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    with torch.device("meta"):
        base = Decoder(n_layers=18, d=2048, ff=5632, heads=16, vocab=VOCAB)
    base = base.to_empty(device="cpu")
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, 0.02)
    budget = int(0.4 * 16 * sum(p.numel() for p in base.parameters()))
    for compiled in (False, True):
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        if compiled:
            compile_layers(m)
        pager.wrap(m, budget=budget, device="cuda")
        ms, peak = measure(make_step(m, torch.optim.AdamW(m.parameters(), lr=1e-4), ids, ids), args.reps)
        rows.append(Row(w, f"pager {budget / GiB:.1f} GiB, {'compiled' if compiled else 'eager'}", ms, peak))
        if compiled:
            rows[-1].ratio, rows[-1].reference = ms / rows[-2].ms, "pager, eager"
        print(rows[-1])
        pager.unwrap(m)
        del m
        free_cuda()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=["forward", "train"])
    args = ap.parse_args(argv)
    env = environment()
    gbps = pinned_h2d_gbps()
    env["pinned_h2d_GBps"] = round(gbps, 1)
    rows: list[Row] = []
    if args.only in (None, "forward"):
        bench_forward(args, rows, gbps)
    if args.only in (None, "train"):
        bench_train(args, rows)
    save(rows, "compile", env)


if __name__ == "__main__":
    main()
