"""Mixture-of-experts inference with the experts paged one by one.

A Qwen3-30B-A3B-shaped `Qwen3MoeForCausalLM` (hidden 2048, 128 experts of
MLP 768, 8 routed, bf16, random weights), `--layers` of its 48 layers, with
transformers' experts implementation `--implementations`:

- decode at batch 1 with the KV cache, fed a fixed sequence of random tokens
  (a random model's own greedy tokens repeat, and so would its routing): ms
  per token, each step ended by the host reading the next token's logits (a
  sync, as `generate()` makes), the mean after the first `--short` steps of
  each pass; the first pass of a freshly wrapped model is reported apart
  (the first call). The routing is drawn (`route`): `uniform` (the worst
  case for a cache) and `zipf` (skewed, as trained models' routing is);
- a prefill of `--prefill` tokens under `grouped_mm` (nearly every expert of
  every layer routed): ms, beside the floor of copying every expert once at the link's pinned rate.

All on the GPU against pager at each budget of `--budgets`, with the next
layer's experts fetched ahead and without (`--ahead`): `scaled` is
`8GiB` for the full depth scaled to the slice (embedding and head once, the
rest by depth). The floor of a paged token is the experts' bytes it copied at
the link's pinned rate.

`--shape mixtral`: a Mixtral-8x7B-shaped model instead (8 experts of MLP
14336, 2 routed; `scaled` is then 24 GiB for its 32 layers). `--accelerate`:
accelerate's `device_map="auto"` with the same GPU memory beside each budget.

`--cold`: where the experts the cache lacks run (`cold_experts`: `device`,
copied in; `auto`, some computed on the host by measured cost; `host`).

    python -m benchmarks.bench_moe [--layers 16] [--budgets scaled,8GiB] [--shape qwen3|mixtral] [--accelerate]
        [--cold device,auto]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import pager
from benchmarks.harness import GiB, Row, environment, free_cuda, pinned_h2d_gbps, save

# (full depth, vocabulary, budget at full depth) of each shape
SHAPES = {"qwen3": (48, 151936, 8 * GiB), "mixtral": (32, 32000, 24 * GiB)}


def config(shape: str, layers: int):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if shape == "mixtral":  # Mixtral-8x7B: 8 experts of MLP 14336, 2 routed
        return MixtralConfig(
            vocab_size=SHAPES[shape][1], hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=4096,
        )  # fmt: skip
    return Qwen3MoeConfig(
        vocab_size=SHAPES[shape][1], hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096,
    )  # fmt: skip


def scaled_budget(model, shape: str, layers: int) -> int:
    """The shape's budget for the full depth, scaled: embedding and head once, the rest by depth."""
    full, _vocab, budget = SHAPES[shape]
    once = sum(p.numel() * p.element_size() for m in (model.model.embed_tokens, model.lm_head) for p in m.parameters())
    return once + (budget - once) * layers // full


def route(model, kind: str) -> list:
    """Make each router choose its k experts by drawing them, without
    replacement, token by token: `uniform` (every expert alike, no locality
    from token to token: the worst case for a cache) or `zipf` (an expert's
    chance 1/rank, the ranks a random order per layer: some experts chosen
    far more often than others). `model`: the random routers' own choice
    (a random model's hidden states route most tokens alike). Returns the hooks' handles."""
    if kind == "model":
        return []
    handles = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue
        n = gate.num_experts
        weight = torch.ones(n) if kind == "uniform" else 1.0 / torch.arange(1, n + 1, dtype=torch.float)
        weight = weight[torch.randperm(n, generator=torch.Generator().manual_seed(i))]
        probs = (weight / weight.sum()).cuda()  # (drawn where the model runs: no copy, no sync)

        def draw(module, args, out, probs=probs):
            logits, scores, index = out
            chosen = torch.multinomial(probs.expand(index.shape[0], -1), index.shape[1])
            return logits, scores, chosen.to(index.dtype)

        handles.append(gate.register_forward_hook(draw))
    return handles


def decode_passes(model, prompt, passes: list, short: int, seen=None) -> list:
    """Per pass of tokens: ms per step after the first `short`, and the
    greedy tokens. `seen(start)`: called at the first and last timed step of
    each pass (start True, then False): what pager counts there is the
    decode's, not the prompt's."""
    out = []
    with torch.no_grad():
        for i, tokens in enumerate(passes):
            torch.cuda.manual_seed(1000 + i)  # (the routing drawn: the same for every model)
            pkv = model(prompt, use_cache=True).past_key_values
            times, chosen = [], []
            for n, t in enumerate(tokens):
                if seen is not None and n == short:
                    seen(True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step = model(t.view(1, 1), past_key_values=pkv, use_cache=True)
                chosen.append(int(step.logits[0, -1].argmax()))  # (the sync a token's choice makes)
                times.append((time.perf_counter() - t0) * 1e3)
                pkv = step.past_key_values
            if seen is not None:
                seen(False)
            out.append((statistics.mean(times[short:]), chosen))
    return out


class DecodeCounts:
    """pager's counters summed over the timed decode steps of passes after the first."""

    def __init__(self, pg):
        self.pg, self.passes, self.steps = pg, 0, 0
        self.hits = self.misses = self.moved = self.ahead = self.ahead_used = self.host = 0
        self._start = None

    def __call__(self, start: bool) -> None:
        s = self.pg.stats()
        if start:
            self._start = s
            return
        self.passes += 1
        if self.passes == 1:
            return  # (the first pass: its first calls)
        a = self._start
        self.hits += s.expert_hits - a.expert_hits
        self.misses += s.expert_misses - a.expert_misses
        self.moved += s.expert_h2d_bytes - a.expert_h2d_bytes
        self.ahead += s.expert_ahead - a.expert_ahead
        self.ahead_used += s.expert_ahead_used - a.expert_ahead_used
        self.host += s.expert_host - a.expert_host


def prefill_ms(model, ids) -> float:
    """A prefill's time, under the `grouped_mm` experts implementation (as generate() runs it)."""
    implementation = model.config._experts_implementation
    model.set_experts_implementation("grouped_mm")
    torch.cuda.manual_seed(999)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids, use_cache=False).logits[0, -1].argmax().item()
    ms = (time.perf_counter() - t0) * 1e3
    model.set_experts_implementation(implementation)
    return ms


def run_routing(args, routing: str, gpu, host_state, buffers, bw, base_bytes) -> list:

    g = torch.Generator().manual_seed(7)
    vocab = SHAPES[args.shape][1]
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=g).cuda()
    passes = [torch.randint(0, vocab, (args.new,), generator=g).cuda() for _ in range(1 + args.reps)]
    long = torch.randint(0, vocab, (1, args.prefill), generator=g).cuda()
    experts_bytes = sum(p.numel() * p.element_size() for n, p in gpu.named_parameters() if ".experts." in n)
    name = {"qwen3": "Qwen3-30B-A3B", "mixtral": "Mixtral-8x7B"}[args.shape]
    work = f"{name}-shaped, {args.layers} layers, {routing} routing"
    rows = []
    hooks = route(gpu, routing)
    for impl in args.implementations.split(","):
        gpu.set_experts_implementation(impl)
        decode_passes(gpu, prompt, passes[:1], args.short)  # (warm: kernels chosen, allocator's pools)
        ref = decode_passes(gpu, prompt, passes, args.short)
        ref_ms = statistics.mean(ms for ms, _t in ref[1:])
        prefill_ms(gpu, long)
        ref_prefill = min(prefill_ms(gpu, long) for _ in range(2))
        rows.append(
            Row(
                f"{work}, decode batch 1",
                f"all on the GPU ({impl})",
                ref_ms,
                None,
                None,
                "",
                f"prefill of {args.prefill} tokens {ref_prefill:.1f} ms",
            )
        )
        print(rows[-1], flush=True)
        runs = [(b, a, c) for b in args.budgets.split(",") for a in args.ahead.split(",") for c in args.cold.split(",")]
        for budget, ahead, cold in runs:
            model = cpu_model(args, host_state, buffers, impl)
            route(model, routing)
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            b = scaled_budget(model, args.shape, args.layers) if budget == "scaled" else budget
            # (the all-on-GPU model beside it is the benchmark's, as in base_bytes: the budget is pager's alone)
            pager.wrap(model, budget=b, device="cuda", budget_covers="pager", cold_experts=cold)
            wrap_s = time.perf_counter() - t0
            pg = pager.of(model)
            cache = pg.expert_tables[0].cache
            experts_all = sum(table.num_experts for table in pg.expert_tables)
            if ahead == "off":  # ([Note: experts fetched ahead] off: each call copies what it misses)
                for t in pg.expert_tables:
                    t.next = None
                del t  # (else it keeps its cache's device tensors past this row)
            counts = DecodeCounts(pg)
            got = decode_passes(model, prompt, passes, args.short, counts)
            hits, misses = counts.hits, counts.misses
            moved = counts.moved / (args.reps * (args.new - args.short))  # (a timed decode step's)
            ms = statistics.mean(m for m, _t in got[1:])
            same = all(a[1] == b[1] for a, b in zip(got, ref))
            pre = prefill_ms(model, long)
            floor_prefill = experts_bytes / (bw * 1e9) * 1e3
            label = f"{SHAPES[args.shape][2] // GiB}GiB scaled" if budget == "scaled" else budget
            routed = args.layers * 8 * cache.expert_bytes
            rows.append(
                Row(
                    f"{work}, decode batch 1",
                    f"pager {label} ({pg.budget_bytes / GiB:.2f} GiB; {impl}; ahead {ahead}; cold experts {cold})",
                    ms,
                    (torch.cuda.max_memory_allocated() - base_bytes) / GiB,
                    ms / ref_ms,
                    "all on the GPU",
                    f"cache {cache.capacity} of {experts_all} experts; {hits / max(1, hits + misses):.1%} hit "
                    f"({counts.ahead_used} of {counts.ahead} copied ahead used; "
                    f"{counts.host / max(1, hits + misses + counts.host):.1%} of routed experts on the host, "
                    f"{cache.cold.host_seconds.get(1, 0):.2e} s each (one token) and {cache.cold.overhead_seconds:.2e} "
                    f"a call against {cache.cold.link_seconds or 0:.2e} s to copy; the host's waits at the next "
                    f"routing by cold experts, s: {dict((c, round(w, 5)) for c, w in sorted(cache.cold.wait_seconds.items()))}); "
                    f"{moved / 1e6:.0f} MB of experts a token (routed {routed / 1e6:.0f} MB, "
                    f"all {experts_bytes / 1e6:.0f} MB; floor {moved / (bw * 1e9) * 1e3:.1f} ms); first call "
                    f"{got[0][0]:.1f} ms/token; greedy tokens equal to all-on-GPU: {same}; prefill of {args.prefill} "
                    f"tokens {pre:.0f} ms ({pre / floor_prefill:.2f}x the floor of every expert once, "
                    f"{pre / ref_prefill:.1f}x all on the GPU); wrap {wrap_s:.1f} s",
                    {
                        "first_ms": got[0][0],
                        "host_experts": counts.host,
                        "moved_bytes": moved,
                        "hit": hits / max(1, hits + misses),
                        "prefill_ms": pre,
                        "prefill_floor_ms": floor_prefill,
                        "ref_prefill_ms": ref_prefill,
                    },
                )
            )
            print(rows[-1], flush=True)
            budget_bytes = pg.budget_bytes
            pager.unwrap(model)
            del model, pg, cache
            free_cuda()
            if args.accelerate and ahead == args.ahead.split(",")[-1] and cold == args.cold.split(",")[-1]:
                rows.append(
                    accelerate_row(
                        args, work, impl, routing, host_state, buffers, budget_bytes, label, prompt, passes, ref
                    )
                )
                print(rows[-1], flush=True)
    for h in hooks:
        h.remove()
    return rows


def cpu_model(args, host_state: dict, buffers: dict, impl: str):
    """The model on the CPU, its tensors `host_state`'s (and its buffers'), under experts implementation `impl`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(args.shape, args.layers), dtype=torch.bfloat16).eval()
    model.load_state_dict(copy.copy(host_state), assign=True)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.clone()
    model.set_experts_implementation(impl)
    return model


def accelerate_row(args, work, impl, routing, host_state, buffers, budget_bytes, label, prompt, passes, ref):
    """accelerate's `device_map="auto"` with the same GPU memory: its decode, 2 passes (it is slow)."""
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        return Row(
            f"{work}, decode batch 1",
            f"accelerate device_map=auto, {label}",
            None,
            None,
            None,
            "",
            "accelerate is not installed: skipped",
        )
    model = cpu_model(args, host_state, buffers, impl)
    device_map = infer_auto_device_map(
        model, max_memory={0: budget_bytes, "cpu": 1 << 40}, no_split_module_classes=model._no_split_modules
    )
    model = dispatch_model(model, device_map=device_map)
    route(model, routing)
    torch.cuda.reset_peak_memory_stats()
    got = decode_passes(model, prompt, passes[:2], args.short)
    ms, ref_ms = got[1][0], statistics.mean(m for m, _t in ref[1:])
    on_gpu = sum(1 for d in device_map.values() if d == 0)
    row = Row(
        f"{work}, decode batch 1",
        f"accelerate device_map=auto, {label} ({impl})",
        ms,
        torch.cuda.max_memory_allocated() / GiB,
        ms / ref_ms,
        "all on the GPU",
        f"{on_gpu} of {len(device_map)} modules of its map on the GPU; first pass {got[0][0]:.1f} ms/token; "
        f"greedy tokens equal to all-on-GPU: {all(a[1] == b[1] for a, b in zip(got, ref))}",
    )
    del model
    free_cuda()
    return row


def main(argv=None):
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--accelerate", action="store_true", help="accelerate's device_map='auto' beside, per budget")
    ap.add_argument("--budgets", default="scaled,8GiB")
    ap.add_argument("--implementations", default="batched_mm,grouped_mm")
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--ahead", default="off,on", help="the next layer's experts fetched ahead: off, on or both")
    ap.add_argument("--cold", default="device,auto", help="cold_experts: device, auto, host (each a row)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    bw = pinned_h2d_gbps()
    torch.manual_seed(0)
    with torch.device("cuda"):
        gpu = AutoModelForCausalLM.from_config(config(args.shape, args.layers), dtype=torch.bfloat16).eval()
    buffers = {k: v.to("cpu") for k, v in gpu.named_buffers()}  # (non-persistent ones too: rotary's)
    host_state = {k: v.to("cpu") for k, v in gpu.state_dict().items()}
    base_bytes = torch.cuda.memory_allocated()  # (the all-on-GPU model: not pager's)
    rows = []
    for routing in args.routing.split(","):
        rows += run_routing(args, routing, gpu, host_state, buffers, bw, base_bytes)
    save(rows, "bench_moe", env)


if __name__ == "__main__":
    main()
