"""Mixture-of-experts decode with the experts paged one by one.

A Qwen3-30B-A3B-shaped `Qwen3MoeForCausalLM` (hidden 2048, 128 experts of
MLP 768, 8 routed, bf16, random weights: routing about uniform, the worst
case for a cache), `--layers` of its 48 layers, greedy `generate()` at
batch 1 with the KV cache: ms per token (the mean interval between tokens
after the first `--short`, as bench_generate measures it) all on the GPU and
under pager at each budget, with transformers' experts implementation
`--implementations`. The budgets: `8GiB` scaled to the slice (embedding and
head once, the rest by depth) and the others in `--budgets`. The floor of a
paged token is the experts' bytes it copied at the link's pinned rate; the
first call's ms/token is reported beside the steady state.

    python -m benchmarks.bench_moe [--layers 16] [--budgets scaled,8GiB,32GiB]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import pager
from benchmarks.bench_generate import decode
from benchmarks.harness import GiB, Row, environment, free_cuda, pinned_h2d_gbps, save

FULL_LAYERS = 48


def config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096,
    )  # fmt: skip


def scaled_budget(model, layers: int) -> int:
    """8 GiB for the full depth, scaled: embedding and head once, the rest by depth."""
    once = sum(p.numel() * p.element_size() for m in (model.model.embed_tokens, model.lm_head) for p in m.parameters())
    return once + (8 * GiB - once) * layers // FULL_LAYERS


def run(args) -> list:
    from transformers import AutoModelForCausalLM

    bw = pinned_h2d_gbps()
    torch.manual_seed(0)
    with torch.device("cuda"):
        gpu = AutoModelForCausalLM.from_config(config(args.layers), dtype=torch.bfloat16).eval()
    host_state = {k: v.to("cpu") for k, v in gpu.state_dict().items()}
    ids = torch.randint(0, 151936, (1, args.prompt), device="cuda")
    experts_bytes = sum(p.numel() * p.element_size() for n, p in gpu.named_parameters() if ".experts." in n)
    rows, ref = [], {}
    impls = args.implementations.split(",")
    for impl in impls:
        gpu.set_experts_implementation(impl)
        t0 = time.perf_counter()
        (ref_ms, _med, _worst), gen, _slow = decode(gpu, ids, True, args.short, args.new, args.reps)
        ref[impl] = (ref_ms, gen(args.new)())
        rows.append(
            Row(
                f"Qwen3-30B-A3B-shaped, {args.layers} layers, decode batch 1",
                f"all on the GPU ({impl})",
                ref_ms,
                torch.cuda.max_memory_allocated() / GiB,
                None,
                "",
                f"{time.perf_counter() - t0:.1f} s in all",
            )
        )
        print(rows[-1], flush=True)
    del gpu
    free_cuda()
    torch.cuda.reset_peak_memory_stats()
    for impl in impls:
        ref_ms, ref_tokens = ref[impl]
        for budget in args.budgets.split(","):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config(args.layers), dtype=torch.bfloat16).eval()
            model.load_state_dict(copy.copy(host_state), assign=True)
            model.set_experts_implementation(impl)
            b = scaled_budget(model, args.layers) if budget == "scaled" else budget
            t0 = time.perf_counter()
            pager.wrap(model, budget=b, device="cuda")
            wrap_s = time.perf_counter() - t0
            pg = pager.of(model)
            cache = pg.expert_tables[0].cache
            first = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                pad_token_id=0,
            )
            first_ms = (time.perf_counter() - first) * 1e3 / args.new
            before = pg.stats()
            (ms, _med, worst), gen, _slow = decode(model, ids, True, args.short, args.new, args.reps)
            after = pg.stats()
            tokens = gen(args.new)()
            calls = (2 + args.reps) * args.new  # (decode runs generate 2 + reps times)
            moved = (after.expert_h2d_bytes - before.expert_h2d_bytes) / calls
            hits = after.expert_hits - before.expert_hits
            misses = after.expert_misses - before.expert_misses
            floor = moved / (bw * 1e9) * 1e3
            rows.append(
                Row(
                    f"Qwen3-30B-A3B-shaped, {args.layers} layers, decode batch 1",
                    f"pager {budget if budget != 'scaled' else '8GiB scaled'} ({b / GiB:.2f} GiB; {impl})",
                    ms,
                    torch.cuda.max_memory_allocated() / GiB,
                    ms / ref_ms,
                    "all on the GPU",
                    f"experts cache {cache.capacity} of {args.layers * 128} experts; "
                    f"{hits / max(1, hits + misses):.1%} hit; {moved / 1e6:.0f} MB of experts a token "
                    f"(routed: {args.layers * 8 * cache.expert_bytes / 1e6:.0f} MB; all: {experts_bytes / 1e6:.0f} MB); "
                    f"link floor {floor:.1f} ms; first call {first_ms:.1f} ms/token; wrap {wrap_s:.1f} s; "
                    f"tokens equal to all-on-GPU: {torch.equal(tokens, ref_tokens)}",
                    {
                        "first_ms": first_ms,
                        "moved_bytes": moved,
                        "hit": hits / max(1, hits + misses),
                        "floor_ms": floor,
                        "worst_ms": worst,
                    },
                )
            )
            print(rows[-1], flush=True)
            pager.unwrap(model)
            del model, pg, cache
            free_cuda()
            torch.cuda.reset_peak_memory_stats()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budgets", default="scaled,8GiB,32GiB")
    ap.add_argument("--implementations", default="batched_mm,grouped_mm")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    save(run(args), "bench_moe", env)


if __name__ == "__main__":
    main()
