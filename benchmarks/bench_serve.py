"""Serving on one GPU.

1. Two 7B-shaped bf16 decoders (16 layers, 6.5 GB each) alternate requests
   (1x512 tokens) in one `pager.Pool` whose budget holds 1.5 of them; then
   the same requests from two threads at once; against swapping whole models
   with `.to()` and accelerate's `cpu_offload`, and all on the GPU.
2. Hugging Face `generate()` of a 7B-shaped Llama (16 layers) wrapped under a
   small budget: prefill and decode timed apart, per budget and batch size,
   against the PCIe floor of the bytes each decoded token moved and against
   all on the GPU; the KV cache counted in the budget.

3. `--only kept-order`: decode at batch 1 with the kept set spread through
   the plan (the policy) and with the earliest blocks kept (the one before),
   in turns in one process ([Note: kept blocks spread out] in engine/schedule.py).

    python -m benchmarks.bench_serve [--only pool|generate|kept-order] [--reps 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading
import time

import torch

import pager
from benchmarks.harness import GiB, Row, environment, free_cuda, pinned_h2d_gbps, save, time_ms
from benchmarks.models import build, layer_bytes


def cpu_copy(gpu_model, n_layers):
    model = build("meta", n_layers=n_layers).to_empty(device="cpu").eval()
    model.load_state_dict(gpu_model.state_dict())
    return model


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def pool_rows(args, bw):
    torch.manual_seed(0)
    gpus = [build("cuda", n_layers=args.layers).eval() for _ in range(2)]
    size = layer_bytes(gpus[0]) * args.layers
    budget = int(1.5 * size) + (64 << 20)  # 1.5 models, and the final norms and allocator rounding
    x = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    wl = f"2 models alternating, 1x512 tokens, budget 1.5 models ({budget / 1e9:.2f} GB)"
    rows = []
    with torch.no_grad():
        want = [g(x) for g in gpus]
    gpu_ms = time_ms(no_grad(lambda: [g(x) for g in gpus]), reps=4 * args.reps) / 2
    rows.append(Row(wl, "all on GPU (both resident)", gpu_ms, None, None, "", "per request"))

    models = [cpu_copy(g, args.layers) for g in gpus]
    pool = pager.Pool(budget=budget, device="cuda")
    for name, m in zip("ab", models):
        # (the two all-on-GPU models beside them are the benchmark's: the budget is sized for pager's blocks)
        pager.wrap(m, pool=pool, name=name, budget_covers="pager")
    pair = no_grad(lambda: [m(x) for m in models])
    for _ in range(4):
        pair()  # learn the order; the shares settle
    pool.reset()
    ms = time_ms(pair, warmup=1, reps=args.reps) / 2
    torch.cuda.synchronize()
    s = pool.stats()
    moved = s.h2d_bytes / (2 * (1 + args.reps))  # over the timed pairs and the one before them
    with torch.no_grad():
        err = max(float((m(x) - w).abs().max()) for m, w in zip(models, want))
    floor = moved / (bw * 1e9) * 1e3
    least = max(0.0, 2 * size - (budget - 2 * layer_bytes(gpus[0]))) / 2  # kept sets fill all but a 2-layer window
    kept = {n: sum(b.nbytes() for b in pager.of(m).scheduler.kept) for n, m in zip("ab", models)}
    rows.append(Row(wl, "pager Pool, alternating", ms, s.peak_resident_bytes / GiB, ms / floor,
                    "PCIe floor of bytes moved",
                    f"moved {moved / 1e9:.2f} GB/request ({moved / size:.0%} of a model), the least with a "
                    f"2-layer window {least / 1e9:.2f} GB ({ms / (least / (bw * 1e9) * 1e3):.2f}x its floor); "
                    f"kept a {kept['a'] / 1e9:.2f} GB, b {kept['b'] / 1e9:.2f} GB; max |diff| vs GPU {err:g}",
                    {"h2d_bytes_per_request": moved, "budget": budget, "err": err}))
    print(rows[-1], flush=True)

    # The same requests from two threads at once (a server's workers).
    per_thread = 2 * args.reps

    def worker(m):
        with torch.no_grad():
            for _ in range(per_thread):
                m(x)
        torch.cuda.current_stream().synchronize()

    warm = [threading.Thread(target=worker, args=(m,)) for m in models]  # the pagers enter their shared mode
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    times = []
    pool.reset()
    for _ in range(3):
        threads = [threading.Thread(target=worker, args=(m,)) for m in models]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / (2 * per_thread))
    s = pool.stats()
    tms = statistics.median(times)
    moved_t = s.h2d_bytes / (3 * 2 * per_thread)
    rows.append(Row(wl, "pager Pool, 2 threads at once", tms, s.peak_resident_bytes / GiB,
                    tms / (moved_t / (bw * 1e9) * 1e3), "PCIe floor of bytes moved",
                    f"wall time per request; moved {moved_t / 1e9:.2f} GB/request; {s.waits} waits for room "
                    f"({s.waited_seconds * 1e3:.0f} ms in all), {s.timeouts} timed out",
                    {"h2d_bytes_per_request": moved_t, "waits": s.waits}))
    print(rows[-1], flush=True)
    for m in models:
        pager.unwrap(m)
    del gpus
    free_cuda()

    def swap():
        with torch.no_grad():
            for m in models:
                m.to("cuda")
                m(x)
                m.to("cpu")

    ms = time_ms(swap, warmup=1, reps=2) / 2
    rows.append(Row(wl, ".to() swap of whole models (pageable)", ms, None, ms / floor,
                    "pager's PCIe floor", "moves the model in and out per request"))
    print(rows[-1], flush=True)
    try:
        from accelerate import cpu_offload
    except ImportError:
        rows.append(Row(wl, "accelerate cpu_offload", None, note="skipped: accelerate not installed"))
    else:
        for m in models:
            cpu_offload(m, execution_device=torch.device("cuda", 0))
        ms = time_ms(pair, warmup=1, reps=2) / 2
        rows.append(Row(wl, "accelerate cpu_offload", ms, None, ms / floor, "pager's PCIe floor",
                        "streams every layer per request"))
        print(rows[-1], flush=True)
    del models
    free_cuda()
    return rows


def llama(layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        gpu = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16).eval()
    return gpu


def generate_rows(args, bw):
    try:
        gpu = llama(args.layers)
    except ImportError:
        return [Row("generate", "pager", None, note="skipped: transformers not installed")]
    model = copy.deepcopy(gpu).to("cpu")
    # (the all-on-GPU model beside it, the rows' reference, is the benchmark's: the budget is pager's alone)
    pager.wrap(model, budget="2GiB", device="cuda", budget_covers="pager")
    pg = pager.of(model)
    rows = []
    new = args.new_tokens
    for budget in args.budgets.split(","):
        pg.set_budget(budget)
        for batch in map(int, args.batches.split(",")):
            ids = torch.randint(0, 32000, (batch, args.prompt), device="cuda")

            def gen(m, n):
                return lambda: m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

            gen(model, 2)()  # learn the order of prefill and decode
            pg.reset()
            torch.cuda.reset_peak_memory_stats()
            prefill_ms = time_ms(gen(model, 1), warmup=1, reps=args.reps)
            full_ms = time_ms(gen(model, 1 + new), warmup=0, reps=args.reps)
            s1 = pg.stats()
            pg.reset()
            gen(model, 1)()
            prefill_bytes = pg.stats().h2d_bytes
            pg.reset()
            out = gen(model, 1 + new)()
            s = pg.stats()
            per_token_bytes = (s.h2d_bytes - prefill_bytes) / new
            decode_ms = (full_ms - prefill_ms) / new
            floor = per_token_bytes / (bw * 1e9) * 1e3
            streamed = [b.nbytes() for b in pg.blocks if not b.resident_for_life]
            room = pg.budget_bytes - pg.fixed_bytes() - s.peak_carried_bytes - 2 * max(streamed)
            least = max(0, sum(streamed) - max(room, 0))
            g_prefill = time_ms(gen(gpu, 1), warmup=1, reps=args.reps)
            g_full = time_ms(gen(gpu, 1 + new), warmup=0, reps=args.reps)
            g_decode = (g_full - g_prefill) / new
            want = gen(gpu, 1 + new)()
            agree = float((out == want).float().mean())
            with torch.no_grad():
                diff = float((model(ids).logits - gpu(ids).logits).abs().max())
            wl = f"generate, 7B-shaped Llama {args.layers} layers, prompt {args.prompt}, batch {batch}"
            rows.append(Row(
                wl, f"pager, budget {budget}: decode per token", decode_ms, s1.allocator_peak_bytes / GiB,
                decode_ms / floor if floor else None, "PCIe floor of bytes per token",
                f"{batch * 1e3 / decode_ms:.1f} tokens/s; moved {per_token_bytes / 1e9:.2f} GB/token; prefill "
                f"{prefill_ms:.0f} ms ({prefill_bytes / 1e9:.2f} GB); KV cache {s.peak_carried_bytes / 1e9:.2f} GB "
                f"in the budget; all on GPU {g_decode:.1f} ms/token ({batch * 1e3 / g_decode:.0f} tokens/s), "
                f"prefill {g_prefill:.0f} ms; tokens equal to all on GPU's {agree:.0%}, max |logit diff| {diff:.3g}; "
                f"the least that must move with a 2-block window: {least / 1e9:.2f} GB/token "
                f"({decode_ms / (least / (bw * 1e9) * 1e3):.2f}x its floor)",
                {"tokens_per_s": batch * 1e3 / decode_ms, "bytes_per_token": per_token_bytes,
                 "prefill_ms": prefill_ms, "carried": s.peak_carried_bytes, "gpu_decode_ms": g_decode}))
            print(rows[-1], flush=True)
    pager.unwrap(model)
    del gpu, model
    free_cuda()
    return rows


def kept_order_rows(args, bw):
    """Decode per token with each order of the kept set, in turns (the order
    is forced by wrapping the scheduler's choice: an A/B, not an option)."""
    from pager.engine.schedule import Scheduler

    try:
        gpu = llama(args.layers)
    except ImportError:
        return [Row("kept order", "pager", None, note="skipped: transformers not installed")]
    model = copy.deepcopy(gpu).to("cpu")
    del gpu
    free_cuda()
    pager.wrap(model, budget="2GiB", device="cuda")
    pg = pager.of(model)
    ids = torch.randint(0, 32000, (1, args.prompt), device="cuda")
    choose, forced = Scheduler.choose_kept, {"order": "spread"}

    def choose_forced(self, budget, size_of, fixed, order="early"):
        return choose(self, budget, size_of, fixed, forced["order"])

    def gen_ms(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    rows, new = [], args.new_tokens
    Scheduler.choose_kept = choose_forced
    try:
        for budget in args.budgets.split(","):
            pg.set_budget(budget)
            times = {"spread": [], "early": []}
            for _ in range(args.reps):
                for order in times:
                    forced["order"] = order
                    pg.hooks._kept_key = None  # choose again at the next step
                    gen_ms(2)
                    prefill = gen_ms(1)
                    times[order].append((gen_ms(1 + new) - prefill) / new)
            pg.reset()
            forced["order"] = "spread"
            pg.hooks._kept_key = None
            gen_ms(2)
            pg.reset()
            gen_ms(1)
            prefill_bytes = pg.stats().h2d_bytes
            pg.reset()
            gen_ms(1 + new)
            per_token = (pg.stats().h2d_bytes - prefill_bytes) / new
            floor = per_token / (bw * 1e9) * 1e3
            spread, early = (statistics.median(times[k]) for k in ("spread", "early"))
            rows.append(Row(f"decode, batch 1, budget {budget}, in turns", "kept spread through the plan", spread,
                            None, spread / floor, "PCIe floor of bytes per token",
                            f"kept earliest: {early:.1f} ms ({early / floor:.2f}x); {per_token / 1e9:.2f} GB/token"))
            print(rows[-1], flush=True)
    finally:
        Scheduler.choose_kept = choose
    pager.unwrap(model)
    free_cuda()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="pool or generate")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budgets", default="2GiB,4GiB")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    env = environment()
    bw = pinned_h2d_gbps()
    env["pinned_h2d_GBps"] = round(bw, 1)
    print(f"pinned H2D: {bw:.1f} GB/s", flush=True)
    rows = []
    if args.only in ("", "pool"):
        rows += pool_rows(args, bw)
    if args.only in ("", "generate"):
        rows += generate_rows(args, bw)
    if args.only == "kept-order":
        rows += kept_order_rows(args, bw)
    save(rows, "serve" + (f"_{args.only}" if args.only else ""), env)
    return rows


if __name__ == "__main__":
    main()
