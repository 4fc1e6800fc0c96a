"""Decode as a Hugging Face user runs it, and pager's host time per block use.

1. `per-use`: a model of many small blocks (`Linear(64, 64)` layers, and
   decoder layers 64 wide of nine modules with tensors each, as a Llama
   layer has) under a budget of a quarter of them, on the GPU: a forward is
   bound by the host, so (paged - bare) / uses is pager's host time per
   block use. At 16, 64 and 256 blocks: it must not grow with the number of
   blocks. `--device cpu` (the default without a GPU) measures the CPU
   device instead, where the bare forward's time is its compute.
2. `generate`: a 7B-shaped `LlamaForCausalLM` (hidden 4096, bf16, random
   weights) saved with `save_pretrained` and loaded back with
   `from_pretrained` on the CPU, wrapped under the budget; greedy
   `generate()` with the KV cache, with and without `pad_token_id`, at each
   batch, plain and with `compress="int4"`. Decode per token is the mean
   interval between tokens after the first `--short`, on the host's clock
   when generate checks its stopping criteria (it syncs there), as the
   user's loop sees it.
3. `load`: the time to the first token from the folder, `pager.from_pretrained`
   against accelerate's `from_pretrained(device_map="auto")` with the same
   GPU budget. The floor is the bytes a token
   moves at the link's pinned rate; link busy is the copy stream's measured
   busy time over the decode time.
4. `first-call`: the first `generate()` calls of a fresh process (torch's and
   cuDNN's caches cold), pager and all on the GPU, each in a process of its
   own: ms/token from the 3rd token of each of 4 successive calls of `--new`
   tokens, with torch's choice of attention kernel and with cuDNN's turned
   off (`--attention default,flash`).

    python -m benchmarks.bench_generate [--only per-use|generate|load|first-call] [--batches 1,8,64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time

import torch

import pager
from benchmarks.harness import GiB, Row, environment, free_cuda, interleaved_ms, out_path, pinned_h2d_gbps, save
from benchmarks.models import Decoder


def write_profile(fn, times: int, name: str) -> None:
    """cProfile of `fn()` run `times` times, its top 40 by own time and by
    cumulative time, under $OUT."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(times):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    with open(out_path(name), "w") as f:
        f.write(text.getvalue())


# ----------------------------------------------------------------- per use
def _small_model(shape: str, n: int):
    """`n` blocks of a small shape: `linear`, a `Linear(64, 64)` each (one
    module, two tensors); `layer`, a decoder layer 64 wide (nine modules with
    tensors, as a Llama layer has: what a streamed use swaps and checks)."""
    if shape == "linear":
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(n)]), torch.randn(4, 64)
    return Decoder(n_layers=n, d=64, ff=172, heads=4), torch.randn(1, 4, 64)


def per_use_rows(args) -> list:
    rows = []
    for shape in args.shapes.split(","):
        for n in map(int, args.blocks.split(",")):
            rows.append(_per_use_row(args, shape, n))
            print(rows[-1], flush=True)
    return rows


def _per_use_row(args, shape: str, n: int) -> Row:
    torch.manual_seed(0)
    bare, x = _small_model(shape, n)
    paged, _x = _small_model(shape, n)
    paged.load_state_dict(bare.state_dict())
    bare, x = bare.to(args.device), x.to(args.device)
    blocks = list(paged) if shape == "linear" else list(paged.layers)
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    # (the bare model beside it on the GPU is the benchmark's: the budget is sized for pager's blocks)
    budget = max(4, n // 4) * block_bytes * 2
    pager.wrap(paged, budget=budget, device=args.device, blocks=blocks, budget_covers="pager")

    def run(m):
        def fwd():
            with torch.no_grad():
                m(x)
        return fwd

    (dev_p, host_p), (dev_b, host_b) = interleaved_ms([run(paged), run(bare)], reps=args.reps * 8)
    with torch.no_grad():
        same = torch.equal(paged(x), bare(x))
    if args.profile and n == max(map(int, args.blocks.split(","))):
        write_profile(run(paged), 10, f"profile_per_use_{shape}_{n}.txt")
    s = pager.of(paged).stats()
    per_use_us = (max(dev_p, host_p) - max(dev_b, host_b)) * 1e3 / n
    what = "Linear(64, 64) blocks" if shape == "linear" else "decoder layers 64 wide (9 modules each)"
    row = Row(
        f"forward of {n} {what}, a quarter resident", "pager: host time per block use (us)",
        per_use_us, None, None, "", f"paged {max(dev_p, host_p):.2f} ms, bare {max(dev_b, host_b):.2f} ms per "
        f"forward; {s.misses} misses, {s.prefetches} prefetches; output equal to bare: {same}",
        {"shape": shape, "blocks": n, "paged_ms": max(dev_p, host_p), "bare_ms": max(dev_b, host_b)})
    pager.unwrap(paged)
    del bare, paged
    free_cuda()
    return row


# ----------------------------------------------------------------- generate
def llama_folder(args, folder: str):
    """A random 7B-shaped Llama saved the way users get one: `save_pretrained`."""
    from transformers import LlamaForCausalLM

    config = _llama_config(args)
    torch.manual_seed(0)
    with torch.device("cuda"):
        gpu = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    gpu.save_pretrained(folder)
    return gpu


def load_cpu(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def decode(model, ids, pad: bool, short: int, new: int, reps: int):
    """Decode ms per token: (mean, median, slowest) of the intervals between
    tokens after the first `short` ones, over `reps` runs of `new` tokens
    (after one unmeasured run); a function that runs generate for n tokens;
    and the slowest tokens: (ms, rep, token, misses, MB fetched, GC ms)."""
    import gc

    from transformers import StoppingCriteria, StoppingCriteriaList

    try:
        counters = pager.of(model).counters
    except ValueError:  # (not wrapped: the model all on the GPU)
        counters = None
    gc_ms = [0.0]
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_start[0]) * 1e3

    class Stamps(StoppingCriteria):
        """When each token is out (HF checks its stopping criteria at every
        token, on the host, after a sync: the user's own clock)."""

        def __init__(self):
            self.marks = []

        def __call__(self, input_ids, scores, **kwargs):
            c = counters
            self.marks.append((time.perf_counter(), c.misses if c else 0, c.h2d_bytes if c else 0, gc_ms[0]))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    kw = {"pad_token_id": 0} if pad else {}
    mask = torch.ones_like(ids)

    def gen(n, stamps=None):
        criteria = StoppingCriteriaList([stamps]) if stamps is not None else None
        return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, stopping_criteria=criteria, **kw)

    gen(2)()  # learn prefill's and decode's orders
    gen(new)()  # and the steady state (the allocator's pools, the kept set as the cache grows)
    intervals, tokens = [], []
    gc.callbacks.append(on_gc)
    try:
        for rep in range(reps):
            stamps = Stamps()
            wall_ms(gen(new, stamps))
            marks = stamps.marks[short:]
            for i, (a, b) in enumerate(zip(marks, marks[1:])):
                ms = (b[0] - a[0]) * 1e3
                intervals.append(ms)
                tokens.append((round(ms, 1), rep, short + i + 1, b[1] - a[1], round((b[2] - a[2]) / 1e6),
                               round(b[3] - a[3], 1)))
    finally:
        gc.callbacks.remove(on_gc)
    slowest = sorted(tokens, reverse=True)[:3]
    return (statistics.mean(intervals), statistics.median(intervals), max(intervals)), gen, slowest


def link_gaps(pg, top: int = 5) -> dict:
    """From a trace of one decode step: the copy stream's busy share from the
    step's first compute to its last, and its largest idle gaps (before
    which block's fetch)."""
    torch.cuda.synchronize()
    steps = [s for s in pg.tracer.steps if s]
    step = steps[-2] if len(steps) > 1 else steps[-1]  # a whole step (the last may be cut short)
    base = step[0][2]
    at = lambda e: base.elapsed_time(e)  # noqa: E731  (ms from the step's first span)
    fetches = sorted((at(s), at(e), b) for k, b, s, e, _n in step if k == "fetch")
    computes = [(at(s), at(e)) for k, _b, s, e, _n in step if k == "compute"]
    if not fetches or not computes:
        return {}
    t0, t1 = min(c[0] for c in computes), max(c[1] for c in computes)
    busy, gaps, end = 0.0, [], t0
    for s, e, b in fetches:
        if s > end:
            gaps.append((s - end, b, end - t0))
        busy += max(0.0, min(e, t1) - max(s, end, t0))
        end = max(end, e)
    if t1 > end:
        gaps.append((t1 - end, "<end of step>", end - t0))
    gaps.sort(reverse=True)
    return {"step_ms": t1 - t0, "busy_ms": busy, "uses": len(computes), "fetches": len(fetches),
            "gaps": [(round(g, 3), b, round(pos, 3)) for g, b, pos in gaps[:top]]}


def generate_rows(args, bw) -> list:
    try:
        import transformers  # noqa: F401  (the benchmark's own dependency)
    except ImportError:
        return [Row("generate", "pager", None, note="skipped: transformers not installed")]
    out_dir = os.environ.get("OUT") or "."
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        t = time.perf_counter()
        gpu = llama_folder(args, folder)
        print(f"saved in {time.perf_counter() - t:.0f} s", flush=True)
        for codec in args.compress.split(","):
            t = time.perf_counter()
            model = load_cpu(folder)
            # (the all-on-GPU model `gpu` beside it, the rows' reference, is the benchmark's: the budget is
            # sized for pager's blocks and KV cache)
            pager.wrap(model, budget=args.budget, device="cuda", compress=None if codec == "none" else codec,
                       budget_covers="pager")
            print(f"loaded and wrapped ({codec}) in {time.perf_counter() - t:.0f} s", flush=True)
            for batch in map(int, args.batches.split(",")):
                ids = torch.randint(3, 32000, (batch, args.prompt), device="cuda")
                for pad in {"both": (True, False), "yes": (True,), "no": (False,)}[args.pad]:
                    rows.append(one_generate(args, bw, model, gpu, ids, pad, codec, out_dir))
            pager.unwrap(model)
            del model
            free_cuda()
    del gpu
    free_cuda()
    return rows


def one_generate(args, bw, model, gpu, ids, pad, codec, out_dir) -> Row:
    pg = pager.of(model)
    batch = ids.shape[0]
    (ms, median_ms, slowest_ms), gen, slow_tokens = decode(model, ids, pad, args.short, args.new, args.reps)
    pg.reset()
    gen(args.short)()
    short_bytes, short_copy = pg.stats().h2d_bytes, pg.stats().h2d_seconds
    pg.reset()
    out = gen(args.new)()
    s = pg.stats()
    tokens = args.new - args.short
    per_token_bytes = (s.h2d_bytes - short_bytes) / tokens
    copy_ms = (s.h2d_seconds - short_copy) / tokens * 1e3
    floor = per_token_bytes / (bw * 1e9) * 1e3
    (gpu_ms, _m, _s), _g, _t = decode(gpu, ids, pad, args.short, args.new, args.reps)
    want = gpu.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                        min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    agree = float((out == want).float().mean())
    gaps = {}
    if args.trace:
        pg.start_trace(steps=3)
        gen(args.short)()
        gaps = link_gaps(pg)
        if args.trace_json:
            pg.trace(os.path.join(out_dir, f"trace_b{batch}_{codec}_{'pad' if pad else 'nopad'}.json"))
        pg.tracer.start(0)  # (off again)
    if args.profile:
        write_profile(gen(args.short), 1, f"profile_b{batch}_{codec}.txt")
    wl = f"generate, 7B-shaped Llama {args.layers} layers, batch {batch}, prompt {args.prompt}"
    method = (f"pager {args.budget}" + (f", {codec}" if codec != "none" else "")
              + (", pad_token_id" if pad else ", no pad_token_id"))
    row = Row(wl, method, ms, torch.cuda.max_memory_allocated() / GiB, ms / floor if floor else None,
              "PCIe floor of its bytes per token",
              f"{per_token_bytes / 1e9:.2f} GB/token, floor {floor:.1f} ms; tokens' median {median_ms:.1f} ms, "
              f"slowest {slowest_ms:.1f} ms; link busy {copy_ms / ms:.0%} of decode; slowest tokens (ms, rep, "
              f"token, misses, MB fetched, GC ms): {slow_tokens}; "
              f"all on GPU {gpu_ms:.1f} ms/token; tokens equal to all on GPU's: {agree:.0%}"
              + (f"; traced step {gaps['step_ms']:.1f} ms, copies busy {gaps['busy_ms']:.1f} ms, largest gaps "
                 f"(ms, before, at ms): {gaps['gaps']}" if gaps else ""),
              {"median_ms": median_ms, "slowest_ms": slowest_ms, "slow_tokens": slow_tokens,
               "bytes_per_token": per_token_bytes, "floor_ms": floor, "copy_ms": copy_ms, "gpu_ms": gpu_ms,
               "agree": agree, "gaps": gaps, "batch": batch, "pad": pad, "codec": codec})
    print(row, flush=True)
    return row


# ----------------------------------------------------------------- loading
def load_rows(args) -> list:
    """Time to the first token from a `save_pretrained` folder: pager's
    one-liner against accelerate's `device_map="auto"` with the same GPU
    budget (the folder is in the page cache for both: just written)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return [Row("load", "pager", None, note="skipped: transformers not installed")]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        llama_folder(args, folder)  # (the model it built on the GPU is dropped: only the folder is wanted)
        free_cuda()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(3, 32000, (1, args.prompt), device="cuda")
        kw = dict(do_sample=False, pad_token_id=0)
        outs = {}
        for method in ("pager.from_pretrained", "accelerate device_map=auto"):
            t0 = time.perf_counter()
            if method.startswith("pager"):
                model = pager.from_pretrained(folder, budget=args.budget, device="cuda")
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    folder, dtype=torch.bfloat16, device_map="auto",
                    max_memory={0: args.budget, "cpu": "100GiB"}).eval()
            loaded = time.perf_counter() - t0
            first = model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            torch.cuda.synchronize()
            ttft = time.perf_counter() - t0
            short, long, outs[method] = _two_lengths(model, ids, kw)
            rows.append(Row(f"load a 7B-shaped Llama folder ({args.layers} layers) under {args.budget}, then "
                            f"generate", method, ttft * 1e3, torch.cuda.max_memory_allocated() / GiB, None, "",
                            f"built and loaded in {loaded:.1f} s; first token {ttft:.1f} s after the call; then "
                            f"{(long - short) / 8:.0f} ms/token; first token {first[0, -1].item()}",
                            {"load_s": loaded, "ttft_s": ttft, "decode_ms": (long - short) / 8}))
            print(rows[-1], flush=True)
            if method.startswith("pager"):
                pager.unwrap(model)
            del model
            free_cuda()
            torch.cuda.reset_peak_memory_stats()
        a, b = outs.values()
        rows[-1].note += f"; tokens equal to pager's: {float((a == b).float().mean()):.0%}"
    return rows


def _two_lengths(model, ids, kw):
    """Wall ms of generate for 2 and 10 new tokens, and the 10 tokens."""
    def gen(n):
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    gen(2)  # (pages still being read from the files land; decode's order is learned)
    short = wall_ms(lambda: gen(2))
    out = gen(10)
    return short, wall_ms(lambda: gen(10)), out


# ----------------------------------------------------------------- first call
FIRST_CALLS = 4


def first_call_child(args) -> None:
    """One fresh process's first `generate()` calls; prints a JSON line."""
    import json

    from transformers import StoppingCriteria, StoppingCriteriaList

    method, attention, batch = args.first_call_child.split(",")
    if attention == "flash":
        torch.backends.cuda.enable_cudnn_sdp(False)
    config = _llama_config(args)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    paged = method != "gpu"
    if paged:
        model.cpu()
        free_cuda()
        pager.wrap(model, budget=args.budget, device="cuda", compress="int4" if method == "pager-int4" else None)
    counters = pager.of(model).counters if paged else None
    ids = torch.randint(3, 32000, (int(batch), args.prompt), device="cuda")

    class Stamps(StoppingCriteria):
        def __init__(self):
            self.marks = []

        def __call__(self, input_ids, scores, **kwargs):
            self.marks.append((time.perf_counter(), counters.h2d_bytes if counters else 0))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    calls = []
    for _ in range(FIRST_CALLS):
        stamps = Stamps()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                       do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([stamps]))
        m = stamps.marks[2:]  # (from the 3rd token: prefill and the first decode step are the 1st and 2nd)
        calls.append({"first_token_ms": (stamps.marks[0][0] - t0) * 1e3,
                      "ms": (m[-1][0] - m[0][0]) * 1e3 / (len(m) - 1),
                      "slowest_ms": max(b[0] - a[0] for a, b in zip(m, m[1:])) * 1e3,
                      "bytes_per_token": (m[-1][1] - m[0][1]) / (len(m) - 1)})
    print("FIRST_CALL " + json.dumps({"method": method, "attention": attention, "batch": int(batch),
                                      "calls": calls}), flush=True)


def first_call_rows(args, bw) -> list:
    import json
    import subprocess
    import sys

    try:
        import transformers  # noqa: F401  (the benchmark's own dependency)
    except ImportError:
        return [Row("first call", "pager", None, note="skipped: transformers not installed")]
    results = {}
    for attention in args.attention.split(","):
        for batch in map(int, args.batches.split(",")):
            methods = ["gpu", "pager"] + (["pager-int4"] if "int4" in args.compress.split(",") else [])
            for method in methods:
                cmd = [sys.executable, "-m", "benchmarks.bench_generate", "--first-call-child",
                       f"{method},{attention},{batch}", "--layers", str(args.layers), "--budget", args.budget,
                       "--prompt", str(args.prompt), "--new", str(args.new)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                line = next(x for x in out.splitlines() if x.startswith("FIRST_CALL "))
                results[method, attention, batch] = json.loads(line[len("FIRST_CALL "):])["calls"]
    rows = []
    for (method, attention, batch), calls in results.items():
        gpu = results["gpu", attention, batch]
        floor = calls[-1]["bytes_per_token"] / (bw * 1e9) * 1e3
        first, steady = calls[0]["ms"], calls[-1]["ms"]
        reference = max(floor, gpu[0]["ms"]) if method != "gpu" else None
        rows.append(Row(
            f"generate, 7B-shaped Llama {args.layers} layers, first calls of a fresh process, batch {batch}, "
            f"attention {attention}", method if method == "gpu" else f"{method} {args.budget}", first, None,
            first / reference if reference else None, "max(floor, the same call all on the GPU)",
            "calls 1-4, ms/token from the 3rd token: " + " / ".join(f"{c['ms']:.1f}" for c in calls)
            + f"; first call's slowest token {calls[0]['slowest_ms']:.0f} ms; first token of call 1 "
            f"{calls[0]['first_token_ms']:.0f} ms"
            + (f"; floor {floor:.1f} ms ({calls[-1]['bytes_per_token'] / 1e9:.2f} GB/token); first call / steady "
               f"{first / steady:.2f}x" if method != "gpu" else ""),
            {"calls": calls, "floor_ms": floor, "attention": attention, "batch": batch}))
        print(rows[-1], flush=True)
    return rows


def _llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, eos_token_id=2, bos_token_id=1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="per-use, generate or load")
    ap.add_argument("--blocks", default="16,64,256")
    ap.add_argument("--shapes", default="linear,layer", help="per-use: the blocks' shape (linear, layer)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--pad", default="both", choices=("both", "yes", "no"))
    ap.add_argument("--compress", default="none,int4")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="trace a decode step: the copy stream's idle gaps")
    ap.add_argument("--trace-json", action="store_true", help="and write it under $OUT (Perfetto)")
    ap.add_argument("--profile", action="store_true", help="cProfile of a short generate, under $OUT")
    ap.add_argument("--attention", default="default,flash", help="first-call: torch's choice, or cuDNN's off")
    ap.add_argument("--first-call-child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="per-use only: cpu measures the CPU device (no GPU needed)")
    args = ap.parse_args(argv)
    if args.first_call_child:
        return first_call_child(args)
    if args.device == "cpu" and args.only != "per-use":
        raise SystemExit("bench_generate: on the CPU device only `--only per-use` runs (the rest needs a GPU)")
    env = environment()
    bw = pinned_h2d_gbps() if args.device != "cpu" else 0.0
    env["pinned_h2d_GBps"] = round(bw, 1)
    print(f"{env}", flush=True)
    rows = []
    if args.only in ("", "per-use"):
        rows += per_use_rows(args)
    if args.only in ("", "generate"):
        rows += generate_rows(args, bw)
    if args.only in ("", "load"):
        rows += load_rows(args)
    if args.only in ("", "first-call"):
        rows += first_call_rows(args, bw)
    save(rows, "bench_generate", env)


if __name__ == "__main__":
    main()
