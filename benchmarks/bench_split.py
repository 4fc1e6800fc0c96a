"""One model streamed over several GPUs' links (`split_fetch=`, issue 43 item 3).

The GPU that computes (cuda:0) fetches each block's share over its own PCIe
link while each other GPU fetches its share over its own link and passes it
on over the peer link (NVLink): [Note: split fetch] in
pager/engine/split_fetch.py.

1. `links`: pinned host-to-device GB/s of each GPU alone, of the first k at
   once (a 1 GiB copy each, enqueued together: whether the host feeds k
   links), and each peer copy into cuda:0.
2. Per shape (random-weight `transformers` Llamas: a 7B-shaped one and a
   slice of a 70B-shaped one, bf16) and per budget (a share of the model's
   bytes): a forward (prefill, batch 1) and greedy `generate()` per token,
   with the pager on cuda:0's link alone, split over 2 links, ... over all
   the GPUs', and all on cuda:0. One wrap (`split_fetch="all"`) serves every
   pager run: "one link" is the same model with its transport's split set
   aside (`transport.split = None`, the state `split_fetch=None` wraps
   with), and k links a `SplitFetch` of the first k-1 helpers (the state
   `split_fetch=helpers[:k-1]` wraps with), so pages, budget and schedule
   are the same; then over every link with each helper keeping pages up to
   the device's budget ([Note: pages kept on helpers]; the others keep
   none). Tokens are compared with all-on-GPU's.
3. `shares`: the forward at the first budget over every link, with the
   device's own share of each page at 0.4, 0.5 and 0.6 (the rest shared
   evenly by the helpers).

    python -m benchmarks.bench_split [--shapes 7b,70b] [--budgets 0.25,0.5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import pager
from benchmarks.bench_generate import decode
from benchmarks.harness import GiB, Row, environment, free_cuda, save, time_ms
from pager.engine.helper_pages import HelperPages
from pager.engine.split_fetch import SplitFetch
from pager.engine.transport import _Current

SHAPES = {  # hidden, intermediate, layers, heads, kv heads
    "7b": (4096, 11008, 32, 32, 32),
    "70b": (8192, 28672, 8, 64, 8),
}


def link_rows(n: int) -> list:
    """Pinned h2d GB/s of each GPU alone, of all at once (enqueued together:
    whether the host feeds them all), and of each peer copy into cuda:0."""
    nbytes = 1 << 30
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    streams = [torch.cuda.Stream(f"cuda:{i}") for i in range(n)]

    def copy_on(i):
        with torch.cuda.stream(streams[i]):
            devs[i].copy_(host, non_blocking=True)

    def wall_ms(gpus) -> float:
        t = []
        for _ in range(6):
            for i in gpus:
                torch.cuda.synchronize(i)
            t0 = time.perf_counter()
            for i in gpus:
                copy_on(i)  # (pinned copies return at once: all run together)
            for i in gpus:
                torch.cuda.synchronize(i)
            t.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(t[1:])

    rows = []
    for gpus in [[i] for i in range(n)] + [list(range(k)) for k in range(2, n + 1)]:
        ms = wall_ms(gpus)
        name = f"h2d cuda:{gpus[0]} alone" if len(gpus) == 1 else f"h2d cuda:0-{gpus[-1]} at once"
        rows.append(Row("links", name, ms, note=f"{len(gpus) * nbytes / ms / 1e6:.1f} GB/s",
                        extra={"gbps": len(gpus) * nbytes / ms / 1e6}))
    for i in range(1, n):
        with torch.cuda.device(i):
            ms = time_ms(lambda: devs[0].copy_(devs[i], non_blocking=True), warmup=2, reps=5)
        rows.append(Row("links", f"peer cuda:{i} -> cuda:0", ms, note=f"{nbytes / ms / 1e6:.1f} GB/s",
                        extra={"gbps": nbytes / ms / 1e6}))
    for r in rows:
        print(r, flush=True)
    return rows


def build(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    d, ff, layers, heads, kv = SHAPES[shape]
    config = LlamaConfig(vocab_size=32000, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        gpu = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    cpu = copy.deepcopy(gpu).to("cpu")
    return gpu, cpu


def shape_rows(args, shape: str, links: dict, blocks: str = "auto") -> list:
    gpu, model = build(shape)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # (the all-on-GPU model beside it on cuda:0 is the benchmark's: the budgets are shares of the model, pager's)
    pager.wrap(model, budget=int(max(map(float, args.budgets.split(","))) * model_bytes), device="cuda:0",
               split_fetch="all", blocks=None if blocks == "auto" else blocks.split("+"), budget_covers="pager")
    pg = pager.of(model)
    split = pg.transport.split
    helpers = [h.device for h in split.helpers]
    # "split_fetch=helpers[:k]" for each k, on the same pages: the transport with fewer helpers.
    variants = [("one link", None)] + [
        (f"split over {k + 1} links", split if k == len(helpers) else SplitFetch(split.device, helpers[:k], _Current))
        for k in range(1, len(helpers) + 1)] + [(f"split over {len(helpers) + 1} links, pages kept on helpers", split)]
    pg.transport.kept_pages = None  # (set per budget for the last variant)
    ids = torch.randint(3, 32000, (1, args.prompt), device="cuda:0")
    with torch.no_grad():
        gpu_fwd = time_ms(lambda: gpu(ids), warmup=2, reps=args.reps)
    (gpu_tok, _m, _s), _g, _t = decode(gpu, ids[:, :16], True, args.short, args.new, 2)
    want = gpu.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=args.new,
                        min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    rows = []
    n = len(helpers) + 1
    wl = (f"{shape}-shaped Llama bf16, {SHAPES[shape][2]} layers, {model_bytes / GiB:.1f} GiB; links "
          + ", ".join(f"{links[f'h2d cuda:{i} alone']:.1f}" for i in range(n))
          + f" GB/s, {links[f'h2d cuda:0-{n - 1} at once']:.1f} together, peer "
          + ", ".join(f"{links[f'peer cuda:{i} -> cuda:0']:.0f}" for i in range(1, n))
          + f"; {len(pg.blocks)} blocks" + (f" (blocks={blocks})" if blocks != "auto" else ""))
    for share in map(float, args.budgets.split(",")):
        pg.set_budget(int(share * model_bytes))
        times = {}
        for method, helper in variants:
            pg.transport.split = helper
            keeping = method.endswith("kept on helpers")
            # Each helper may hold as much as the device ([Note: pages kept on helpers]).
            pg.transport.kept_pages = HelperPages(split, [int(share * model_bytes)] * len(helpers)) if keeping else None
            with torch.no_grad():
                pg.reset()
                fwd = time_ms(lambda: model(ids), warmup=2, reps=args.reps)
                per_fwd = pg.stats().h2d_bytes / (args.reps + 2)
            (tok, tok_median, _slow), _g, _t = decode(model, ids[:, :16], True, args.short, args.new, 2)
            pg.reset()
            out = model.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=args.new,
                                 min_new_tokens=args.new, do_sample=False, pad_token_id=0)
            s = pg.stats()
            per_token = s.h2d_bytes / args.new
            times[method] = (fwd, tok)
            one = times["one link"]
            rows.append(Row(f"{wl}; budget {share:.0%}", method, fwd, s.peak_resident_bytes / GiB,
                            fwd / one[0], "this budget's one-link forward",
                            f"forward {fwd:.1f} ms ({per_fwd / 1e9:.2f} GB; all on GPU {gpu_fwd:.1f} ms); decode "
                            f"{tok:.1f} ms/token, median {tok_median:.1f}, {tok / one[1]:.2f}x one link's "
                            f"({per_token / 1e9:.2f} GB/token; all on GPU {gpu_tok:.1f} ms); "
                            f"{s.split_fetch_bytes / max(s.h2d_bytes, 1):.0%} of bytes over other GPUs' links, "
                            f"{s.helper_page_bytes / max(s.h2d_bytes, 1):.0%} from their memory "
                            f"({s.helper_held_bytes / GiB:.1f} GiB kept); "
                            f"tokens equal to all on GPU's: {float((out == want).float().mean()):.0%}",
                            {"forward_ms": fwd, "decode_ms": tok, "decode_median_ms": tok_median,
                             "forward_bytes": per_fwd, "token_bytes": per_token, "gpu_forward_ms": gpu_fwd,
                             "gpu_decode_ms": gpu_tok, "budget_share": share, "shape": shape,
                             "split_share": s.split_fetch_bytes / max(s.h2d_bytes, 1), "blocks": len(pg.blocks),
                             "blocks_spec": blocks,
                             "forward_ratio": fwd / one[0], "decode_ratio": tok / one[1],
                             "helper_page_share": s.helper_page_bytes / max(s.h2d_bytes, 1),
                             "helper_held_bytes": s.helper_held_bytes}))
            print(rows[-1], flush=True)
            if keeping:
                pg.transport.kept_pages.clear()
                pg.transport.kept_pages = None
    if args.shares:
        pg.transport.split = split
        pg.set_budget(int(float(args.budgets.split(",")[0]) * model_bytes))
        for own in map(float, args.shares.split(",")):
            split.own_share = own  # (the rest shared evenly by the helpers)
            with torch.no_grad():
                fwd = time_ms(lambda: model(ids), warmup=2, reps=args.reps)
            rows.append(Row(f"{wl}; budget {args.budgets.split(',')[0]}", f"own share {own:.2f}", fwd,
                            extra={"own_share": own, "forward_ms": fwd}))
            print(rows[-1], flush=True)
        split.own_share = 1 / n
    pager.unwrap(model)
    del model, gpu
    free_cuda()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="7b,70b")
    p.add_argument("--budgets", default="0.25,0.5")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--short", type=int, default=3)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shares", default="0.4,0.5,0.6", help="own shares to try with every helper ('' skips)")
    p.add_argument("--blocks", default="auto",
                   help="comma-separated blocks= to run each shape with: 'auto' (pager's choice) or class names "
                        "joined by '+' (LlamaDecoderLayer)")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("bench_split: skipped, needs two CUDA GPUs")
        return
    env = environment()
    rows = link_rows(torch.cuda.device_count())
    links = {r.method: r.extra["gbps"] for r in rows}
    for shape in filter(None, args.shapes.split(",")):
        for blocks in args.blocks.split(","):
            rows += shape_rows(args, shape, links, blocks)
    save(rows, "split", env)


if __name__ == "__main__":
    main()
