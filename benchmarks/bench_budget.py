"""Does the budget hold from the first training step? (issue 63)

A Hugging Face LlamaForCausalLM built from a config (no download), fp32, 16
layers, hidden 2048, intermediate 5632, 16 heads, vocab 32000, untied (~953M
parameters), AdamW with clip_grad_norm_, a 4x1024 batch (labels = input ids).
Every step of every run is measured on its own, the first included:

- all on GPU: the reference (model.cuda(), then the steps);
- pager at budgets of 25%, 40%, 60% and 100% of weights + grads + AdamW state
  (16 bytes a parameter), defaults otherwise, the optimizer built after wrap;
  a refusal (BudgetError, at wrap or at a step) is a result and is reported;
- torchao's CPUOffloadOptimizer where it is installed.

Per step: wall seconds (synchronized), the allocator's peak (its counter reset
at the step's start) and pager's stats (reset at the step's start):
peak_device_bytes, activations_policy, activation_reserve_bytes and
peak_resident_bytes. Per run: the time from the model built on the host to
the end of the first step (wrap, or .cuda(), included) and the steady step
(median of steps 3 on) against all on GPU.

    python -m benchmarks.bench_budget --out DIR [--quick] [--steps 8] [--shares 0.25,0.4,0.6,1.0] [--covers process]

Writes DIR/bench_budget.json (everything, rewritten after each run) and
DIR/bench_budget.md (the tables printed at the end).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

import pager
from benchmarks.harness import GiB, free_cuda, host_cpu

try:
    from pager import BudgetError
except ImportError:  # an older tree
    from pager.base.common import BudgetError

STATE_BYTES_PER_PARAM = 16  # fp32 weights, grads and AdamW's two states
FULL = {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 5632}
OPTIONS = {"clip": True, "attach": False, "covers": None}  # (--no-clip, --attach-at-wrap, --covers)
QUICK = {"num_hidden_layers": 4, "hidden_size": 1024, "intermediate_size": 2816}


# ---------------------------------------------------------------- setup
def llama_config(quick: bool, seq: int):
    from transformers import LlamaConfig

    shape = QUICK if quick else FULL
    return LlamaConfig(
        vocab_size=32000,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=max(2048, seq),
        tie_word_embeddings=False,
        use_cache=False,
        **shape,
    )


def build_model(cfg, seed: int):
    """A LlamaForCausalLM of `cfg` on the host, fp32, in training mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    model.train()
    return model


def git(*args) -> str | None:
    try:
        return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return None


def environment(device: str) -> dict:
    import transformers

    status = git("status", "--porcelain", "--untracked-files=no")
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    return {
        "host": host_cpu(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if cuda else "none",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "commit": os.environ.get("PAGER_COMMIT") or git("rev-parse", "HEAD"),
        "tree_dirty": None if status is None else bool(status),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# ---------------------------------------------------------------- device helpers
class Dev:
    """Synchronize and read the allocator's peak on CUDA; on the CPU (a smoke
    test of this script only) there is no allocator peak."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device.startswith("cuda")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None

    def free(self):
        """gc.collect(), torch.cuda.empty_cache() and the pinned blocks torch's host allocator keeps."""
        if self.cuda:
            free_cuda()
        else:
            gc.collect()


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------- one run
def run_steps(run: dict, model, opt, x, dev: Dev, steps: int, t0: float, paged: bool) -> None:
    """`steps` training steps, each measured on its own, into run["steps"];
    run["setup_first_s"]: from `t0` to the end of the first step. A step that
    raises ends the run (its error recorded by the caller)."""
    pg = pager.of(model) if paged else None
    for i in range(steps):
        dev.sync()
        dev.reset_peak()
        if pg is not None:
            pg.reset()
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if OPTIONS["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        dev.sync()
        end = time.perf_counter()
        rec = {
            "step": i + 1,
            "s": end - start,
            "alloc_peak_bytes": dev.peak(),
            "alloc_after_bytes": dev.allocated(),
            "loss": float(loss.detach()),
        }
        del loss
        if pg is not None:
            s = pg.stats()
            rec.update(
                peak_device_bytes=s.peak_device_bytes,
                activations_policy=s.activations_policy,
                activation_reserve_bytes=s.activation_reserve_bytes,
                peak_resident_bytes=s.peak_resident_bytes,
                peak_activation_bytes=s.peak_activation_bytes,
                budget_bytes=s.budget_bytes,
                h2d_bytes=s.h2d_bytes,
                d2h_bytes=s.d2h_bytes,
                # (updates on the host: how many this step's `opt.step()` gave the host; the seconds of those that
                # ended while this step was measured, some of them the previous step's; and this step's fetches'
                # waits for the previous step's updates)
                host_steps=s.host_steps,
                host_step_seconds=s.host_step_seconds,
                host_step_wait_seconds=s.host_step_wait_seconds,
                # (what the placement of updates went by: training/host_placement.py)
                placement=pg.host_steps.placement.figures(),
            )
        run["steps"].append(rec)
        if i == 0:
            run["setup_first_s"] = end - t0
        print(f"  step {i + 1}: {_step_line(rec, run.get('budget_bytes'))}", flush=True)


def _step_line(rec: dict, budget: int | None) -> str:
    parts = [f"{rec['s']:.3f} s", f"loss {rec['loss']:.3f}"]
    if rec["alloc_peak_bytes"] is not None:
        parts.append(f"allocator peak {rec['alloc_peak_bytes'] / GiB:.2f} GiB")
        if budget:
            parts.append(f"({rec['alloc_peak_bytes'] / budget:.2f}x budget)")
    if "peak_device_bytes" in rec:
        parts.append(
            f"pager peak {rec['peak_device_bytes'] / GiB:.2f} GiB, resident peak "
            f"{rec['peak_resident_bytes'] / GiB:.2f} GiB, reserve {rec['activation_reserve_bytes'] / GiB:.2f} GiB, "
            f"policy {rec['activations_policy']}"
        )
        if rec["host_steps"]:
            parts.append(
                f"{rec['host_steps']} updates on the host in {rec['host_step_seconds'] * 1e3:.0f} ms, "
                f"waited for {rec['host_step_wait_seconds'] * 1e3:.0f} ms"
            )
        parts.append(_placement_line(rec["placement"]))
    return ", ".join(parts)


def _placement_line(f: dict) -> str:
    def ms(x, scale=1e3, unit="ms"):
        return "-" if x is None else f"{x * scale:.1f} {unit}"

    return (
        f"placement: {f['gave_device']} to the device, forward's own {ms(f['forward_seconds'])}, "
        f"an update on the device adds {ms(f['device_update_seconds'])}, the host "
        f"{ms(f['host_seconds_per_byte'], 1e12, 'ms/GB of weights')}"
    )


def summarize(run: dict) -> None:
    """Steady step: median of steps 3 on (of what there is, if fewer)."""
    times = [r["s"] for r in run["steps"]]
    tail = times[2:] or times[1:] or times
    run["steady_s"] = statistics.median(tail) if tail else None


def new_run(name: str, **kw) -> dict:
    return {"name": name, "steps": [], "setup_first_s": None, "steady_s": None, "error": None, "refused": False, **kw}


def run_on_device(name: str, make_opt, cpu_ref, x, dev: Dev, steps: int) -> dict:
    """The model moved to the device whole, `make_opt(parameters)` its
    optimizer: setup (the move included) and each step measured."""
    run = new_run(name)
    model = opt = None
    try:
        model = copy.deepcopy(cpu_ref)
        dev.sync()
        t0 = time.perf_counter()
        model.to(dev.device)
        opt = make_opt(model.parameters())
        run_steps(run, model, opt, x, dev, steps, t0, paged=False)
    except Exception as e:  # noqa: BLE001 - a failed run is recorded, the others go on
        run["error"] = error_text(e)
        run["traceback"] = traceback.format_exc()
        print(f"  failed: {run['error']}", flush=True)
    finally:
        summarize(run)
        del model, opt
        dev.free()
    return run


def run_baseline(cpu_ref, x, dev: Dev, steps: int) -> dict:
    return run_on_device("all on GPU", lambda ps: torch.optim.AdamW(ps, lr=1e-4), cpu_ref, x, dev, steps)


def run_pager(cpu_ref, x, dev: Dev, steps: int, share: float, nparams: int) -> dict:
    budget = int(share * STATE_BYTES_PER_PARAM * nparams)
    run = new_run(f"pager {share:g}", share=share, budget_bytes=budget)
    model = opt = None
    wrapped = False
    try:
        model = copy.deepcopy(cpu_ref)
        dev.sync()
        t0 = time.perf_counter()
        early = torch.optim.AdamW(model.parameters(), lr=1e-4) if OPTIONS["attach"] else None
        covers = {"budget_covers": OPTIONS["covers"]} if OPTIONS["covers"] else {}  # (older trees: their default)
        pager.wrap(model, budget=budget, device=dev.device, optimizer=early, **covers)
        wrapped = True
        run["wrap_s"] = time.perf_counter() - t0
        opt = early or torch.optim.AdamW(model.parameters(), lr=1e-4)
        run_steps(run, model, opt, x, dev, steps, t0, paged=True)
    except BudgetError as e:
        run["refused"] = True
        run["error"] = error_text(e)
        where = "at wrap" if not wrapped else f"at step {len(run['steps']) + 1}"
        run["refused_at"] = where
        print(f"  refused {where}: {e}", flush=True)
    except Exception as e:  # noqa: BLE001
        run["error"] = error_text(e)
        run["traceback"] = traceback.format_exc()
        print(f"  failed: {run['error']}", flush=True)
    finally:
        summarize(run)
        if wrapped:
            try:
                pager.unwrap(model)
            except Exception as e:  # noqa: BLE001
                run["unwrap_error"] = error_text(e)
                print(f"  unwrap failed: {run['unwrap_error']}", flush=True)
        del model, opt
        dev.free()
    return run


def run_torchao(cpu_ref, x, dev: Dev, steps: int) -> dict | None:
    """torchao's CPUOffloadOptimizer, None where torchao is not installed.
    (It moves each gradient to the host as the backward makes it, so
    clip_grad_norm_ finds no gradients on the model to clip.)"""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception:  # noqa: BLE001 - absent, or present but broken: either way not a peer here
        return None
    make = lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW, lr=1e-4)  # noqa: E731
    return run_on_device("torchao CPUOffloadOptimizer", make, cpu_ref, x, dev, steps)


# ---------------------------------------------------------------- report
def _f(v, fmt="{:.2f}", none="-"):
    return none if v is None else fmt.format(v)


def _gib(v) -> str:
    return _f(None if v is None else v / GiB)


def markdown(result: dict) -> str:
    env, cfg, runs = result["env"], result["config"], result["runs"]
    base = next((r for r in runs if r["name"] == "all on GPU"), None)
    base_steady = base and base.get("steady_s")
    steps = result["args"]["steps"]
    state = STATE_BYTES_PER_PARAM * cfg["nparams"]
    out = [
        "## bench_budget: does the budget hold from the first step? (issue 63)",
        "",
        f"GPU {env['gpu']}; host {env['host']}; torch {env['torch']} (CUDA {env['cuda']}), "
        f"transformers {env['transformers']}; commit {env['commit']}"
        + (" (tree with uncommitted changes)" if env.get("tree_dirty") else "")
        + f"; {env['date']}",
        "",
        f"LlamaForCausalLM fp32, {cfg['layers']} layers, hidden {cfg['hidden']}, intermediate "
        f"{cfg['intermediate']}, {cfg['nparams'] / 1e6:.0f}M parameters (weights+grads+AdamW "
        f"{state / GiB:.2f} GiB), batch {cfg['batch']}x{cfg['seq']}, AdamW lr 1e-4 with clip_grad_norm_ 1.0, "
        f"{steps} steps a run; attention {cfg.get('attn_implementation')}.",
        "",
        "    " + result["command"],
        "",
        "Allocator peak: torch.cuda.max_memory_allocated() over the step (reset at its start), input ids "
        "and everything outside pager included. Pager peak: stats().peak_device_bytes (blocks and "
        "activations; reset at each step's start). Steady: median of steps 3 on.",
        "",
        "| share | budget GiB | allocator peak / budget, steps 1.."
        + str(steps)
        + " | max pager peak / budget | steady s | vs all on GPU | wrap+first step s | policy | note |",
        "|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in runs:
        if "share" not in r:
            continue
        b = r["budget_bytes"]
        peaks = [s["alloc_peak_bytes"] for s in r["steps"]]
        per_step = " ".join(_f(p / b if p is not None else None) for p in peaks) or "-"
        pager_peaks = [s["peak_device_bytes"] for s in r["steps"] if "peak_device_bytes" in s]
        pmax = max(pager_peaks) / b if pager_peaks else None
        ratio = r["steady_s"] / base_steady if r.get("steady_s") and base_steady else None
        policies = []
        for s in r["steps"]:
            if s["activations_policy"] not in policies:
                policies.append(s["activations_policy"])
        note = ""
        if r["error"]:
            note = ("refused " + r.get("refused_at", "") + ": " if r["refused"] else "failed: ") + r["error"]
            note = note.replace("|", "\\|").replace("\n", " ")
        out.append(
            f"| {r['share']:.2f} | {b / GiB:.2f} | {per_step} | {_f(pmax)} | {_f(r['steady_s'], '{:.3f}')} | "
            f"{_f(ratio, '{:.2f}x')} | {_f(r['setup_first_s'], '{:.1f}')} | {' -> '.join(policies) or '-'} | {note} |"
        )
    out.append("")
    for r in runs:
        if "share" in r:
            continue
        if r.get("skipped"):
            out.append(f"- {r['name']}: {r['skipped']}")
            continue
        peaks = " ".join(_gib(s["alloc_peak_bytes"]) for s in r["steps"])
        ratio = r["steady_s"] / base_steady if r.get("steady_s") and base_steady else None
        out.append(
            f"- {r['name']}: steady {_f(r['steady_s'], '{:.3f}')} s ({_f(ratio, '{:.2f}x')} all on GPU), "
            f"setup+first step {_f(r['setup_first_s'], '{:.1f}')} s, allocator peak per step GiB: {peaks or '-'}"
            + (f"; failed: {r['error']}" if r["error"] else "")
        )
    out += ["", "Per step (s; allocator peak GiB; pager peak / resident peak / activation reserve GiB; policy):", ""]
    for r in runs:
        if r.get("skipped") or not r["steps"]:
            continue
        out.append(
            f"- {r['name']}: "
            + "; ".join(
                f"{s['step']}: {s['s']:.3f}, {_gib(s['alloc_peak_bytes'])}"
                + (
                    f", {s['peak_device_bytes'] / GiB:.2f}/{s['peak_resident_bytes'] / GiB:.2f}/"
                    f"{s['activation_reserve_bytes'] / GiB:.2f} {s['activations_policy']}"
                    if "peak_device_bytes" in s
                    else ""
                )
                for s in r["steps"]
            )
        )
    return "\n".join(out) + "\n"


def write(result: dict, out_dir: str, md: bool) -> None:
    with open(os.path.join(out_dir, "bench_budget.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    if md:
        text = markdown(result)
        with open(os.path.join(out_dir, "bench_budget.md"), "w") as f:
            f.write(text)
        print("\n" + text, flush=True)


# ---------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.bench_budget")
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for bench_budget.json/.md")
    p.add_argument("--quick", action="store_true", help="4 layers, hidden 1024, intermediate 2816: a smoke run")
    p.add_argument("--steps", type=int, default=8, help="steps a run (default 8)")
    p.add_argument(
        "--shares",
        default="0.25,0.40,0.60,1.00",
        help="budgets as shares of 16 bytes a parameter, comma separated (default 0.25,0.40,0.60,1.00)",
    )
    p.add_argument("--seq", type=int, default=1024, help="tokens a sequence (default 1024)")
    p.add_argument("--batch", type=int, default=4, help="sequences a batch (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the all-on-GPU run")
    p.add_argument("--no-torchao", action="store_true", help="skip the torchao peer")
    p.add_argument("--no-clip", action="store_true", help="no clip_grad_norm_ in the steps")
    p.add_argument(
        "--attach-at-wrap", action="store_true", help="build AdamW before wrap and pass it: wrap(optimizer=)"
    )
    p.add_argument("--covers", choices=("pager", "process"), help="wrap(budget_covers=...) (default: the tree's)")
    p.add_argument("--info", action="store_true", help="pager's INFO log lines (its choices) on stderr")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": a smoke test of this script only
    args = p.parse_args(argv)
    try:
        args.share_list = [float(s) for s in args.shares.split(",") if s.strip()]
    except ValueError:
        p.error(f"--shares {args.shares!r}: a comma separated list of numbers")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    OPTIONS.update(clip=not args.no_clip, attach=args.attach_at_wrap, covers=args.covers)
    if args.info:
        import logging

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("pager").setLevel(logging.INFO)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_budget: CUDA is not available; it measures on CUDA.", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    dev = Dev(args.device)
    env = environment(args.device)
    print(f"host: {env['host']} ({env['cpu_count']} cores)")
    print(f"GPU: {env['gpu']}")
    print(f"torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, python {env['python']}")
    print(f"commit: {env['commit'] or 'unknown'}" + (" (uncommitted changes)" if env.get("tree_dirty") else ""))

    cfg = llama_config(args.quick, args.seq)
    t = time.perf_counter()
    cpu_ref = build_model(cfg, args.seed)
    build_s = time.perf_counter() - t
    nparams = sum(p.numel() for p in cpu_ref.parameters())
    print(
        f"model: LlamaForCausalLM {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{nparams / 1e6:.1f}M params, weights+grads+AdamW {STATE_BYTES_PER_PARAM * nparams / GiB:.2f} GiB; "
        f"built on the host in {build_s:.1f} s",
        flush=True,
    )
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)

    result = {
        "env": env,
        "command": "python -m benchmarks.bench_budget " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: v for k, v in vars(args).items() if k != "share_list"} | {"shares": args.share_list},
        "config": {
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "intermediate": cfg.intermediate_size,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "vocab": cfg.vocab_size,
            "nparams": nparams,
            "batch": args.batch,
            "seq": args.seq,
            "dtype": "float32",
            "attn_implementation": getattr(cpu_ref.config, "_attn_implementation", None),
            "host_build_s": build_s,
        },
        "runs": [],
    }
    runs = result["runs"]
    started = time.perf_counter()

    if not args.no_baseline:
        print("\n# all on GPU", flush=True)
        runs.append(run_baseline(cpu_ref, x, dev, args.steps))
        write(result, args.out, md=False)
    for share in args.share_list:
        print(
            f"\n# pager, budget {share:g} x 16 B/param = {share * STATE_BYTES_PER_PARAM * nparams / GiB:.2f} GiB",
            flush=True,
        )
        try:
            runs.append(run_pager(cpu_ref, x, dev, args.steps, share, nparams))
        except Exception as e:  # noqa: BLE001 - (cleanup failing) never hides the later runs
            runs.append(
                new_run(f"pager {share:g}", share=share, budget_bytes=int(share * 16 * nparams), error=error_text(e))
            )
        write(result, args.out, md=False)
    # The peer last: its optimizer may leave device memory behind that would count in the peaks after it.
    if not args.no_torchao:
        print("\n# torchao CPUOffloadOptimizer", flush=True)
        r = run_torchao(cpu_ref, x, dev, args.steps)
        if r is None:
            print("torchao: absent, skipped", flush=True)
            r = new_run("torchao CPUOffloadOptimizer", skipped="absent, skipped")
        runs.append(r)
    result["total_s"] = time.perf_counter() - started
    write(result, args.out, md=True)
    print(
        f"wrote {os.path.join(args.out, 'bench_budget.json')} and bench_budget.md ({result['total_s']:.0f} s of runs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
