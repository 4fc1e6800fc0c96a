"""A diffusers pipeline from its folder: host memory, load time and the first image.

The Flux-shaped pipeline of `bench_diffusion` (random bf16 weights: the
transformer 23.8 GB, a T5-XXL-shaped encoder 9.8 GB, CLIP-L, Flux's VAE) is
saved as `save_pretrained` writes a pipeline folder (a `model_index.json`, a
subfolder of safetensors per component). Then each method runs in a process
of its own (host memory is that process's): it loads the folder, makes one
1024x1024 image (the first call: what a user waits for) and a second one
(`--steps` steps each). Per method: the process's resident host memory
after the load and at its peak while loading (RSS, sampled every 5 ms;
beside the models' bytes), the load's seconds, the first call's seconds, ms
per denoising step of the second call, peak GPU memory (allocated).

Methods: `pager.from_pretrained(folder, budget=...)` (pages read from the
files into pinned host memory, nothing built in host memory first), at each
of `--budgets`; diffusers' `from_pretrained` then `pager.wrap` (pages copied
from what diffusers built: its steps beside from_pretrained's show what the
pages' layout costs), at each of `--wrap`; diffusers' `from_pretrained` then
`enable_model_cpu_offload`, and then `apply_group_offloading` (block level,
streams: it pins a copy).
The folder is read from the page cache after the first load (it was just
written): the loads are warm ones.

    python -m benchmarks.bench_diffusion_folder [--budgets 8GiB,fifth] [--wrap 8GiB] [--peers model,block] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

import torch

from benchmarks.bench_diffusion import have_diffusers
from benchmarks.harness import GiB, Row, environment, out_path, save

ONE = r"""
import faulthandler, json, logging, signal, sys, threading, time
import psutil, torch
faulthandler.register(signal.SIGUSR1, all_threads=True)  # (run_one asks for every thread's stack at its timeout)
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d ms %(name)s: %(message)s")  # (pager's log: stderr)
logging.getLogger("pager").setLevel(logging.DEBUG)  # (each region pinned, and how long it took)
sys.path.insert(0, {root!r})
import benchmarks.bench_diffusion as bd
import diffusers, pager

bd.ARGS = bd.argparse.Namespace(model="flux", tiny=False, steps={steps}, latent=False)
method, spec, folder = {method!r}, {spec!r}, {folder!r}
process, peak, loading, start = psutil.Process(), [0], [True], time.perf_counter()

def stage(what):  # (where the time went, if the process is stopped before its result)
    rss = process.memory_info().rss / 2**30
    print(f"STAGE {{time.perf_counter() - start:.1f}} s {{what}} rss {{rss:.1f}} GiB", flush=True)


def memory():  # (the page cache and what it has yet to write, before and after the load)
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return " ".join(f"{{k}} {{int(info[k].split()[0]) >> 20}} GiB" for k in ("MemFree", "Cached", "Dirty", "Writeback"))


def disks(pipe):  # (per model: what was read, how, and how long compute waited for it)
    if method != "pager":
        return ""
    out = []
    for name, s in pager.of(pipe).stats().models.items():
        out.append(f"{{name}}: read {{s.disk_read_bytes / 1e9:.1f}} GB ({{s.disk_direct_bytes / 1e9:.1f}} direct, "
                   f"{{s.disk_cached_bytes / 1e9:.1f}} cached) in {{s.disk_read_seconds:.1f}} s, "
                   f"{{s.host_misses}} waits {{s.host_wait_seconds:.1f}} s")
    return "; ".join(out)


stage("started: " + memory())

def watch():
    while loading[0]:
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.005)

torch.cuda.init()
torch.empty(1, device="cuda")
before = process.memory_info().rss
watcher = threading.Thread(target=watch, daemon=True)  # (a load that raises ends the process)
watcher.start()
t0 = time.perf_counter()
faulthandler.dump_traceback_later(30, repeat=True)  # (a load that takes long says where, every 30 s)
tokenizers = dict(tokenizer=bd.Tokens(77), tokenizer_2=bd.Tokens(512))
if method == "pager":
    budget = {budget}
    pipe = pager.from_pretrained(folder, budget=budget, **tokenizers)
else:
    pipe = diffusers.FluxPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16, **tokenizers)
    if method == "wrap":  # (diffusers' load, then pager: its pages a copy of what diffusers built)
        pipe = pager.wrap(pipe, budget={budget})
    elif method == "model":
        pipe.enable_model_cpu_offload()
    else:
        from diffusers.hooks import apply_group_offloading
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module):
                apply_group_offloading(module, onload_device=torch.device("cuda"), offload_type="block_level",
                                       use_stream=True, num_blocks_per_group=1)
torch.cuda.synchronize()
load_s = time.perf_counter() - t0
faulthandler.cancel_dump_traceback_later()
stage("loaded: " + memory() + "; " + disks(pipe))
loading[0] = False
watcher.join()
after = process.memory_info().rss
t0 = time.perf_counter()
bd.call(pipe, bd.ARGS, [])
torch.cuda.synchronize()
first_s = time.perf_counter() - t0
stage("first call: " + memory() + "; " + disks(pipe))
torch.cuda.reset_peak_memory_stats()
times = []
bd.call(pipe, bd.ARGS, times)
steps = [b - a for a, b in zip(times, times[1:])]
print("RESULT " + json.dumps(dict(
    load_s=load_s, first_s=first_s, step_ms=1e3 * sum(steps) / len(steps), rss_after=after - before,
    rss_peak=max(peak[0], after) - before, gpu_peak=torch.cuda.max_memory_allocated(),
    budget=getattr(pager.of(pipe), "budget_bytes", None) if method in ("pager", "wrap") else None)))
"""


def save_folder(folder: str) -> int:
    """The bench's Flux-shaped pipeline saved to `folder`; its models' bytes."""
    import benchmarks.bench_diffusion as bd

    bd.ARGS = argparse.Namespace(model="flux", tiny=False, double=19, single=38)
    torch.manual_seed(0)
    models = bd.components(bd.ARGS, "cuda")
    index = {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    total = 0
    for name, model in models.items():
        library = "transformers" if type(model).__module__.startswith("transformers") else "diffusers"
        index[name] = [library, type(model).__name__]
        model.save_pretrained(os.path.join(folder, name))
        total += sum(t.numel() * t.element_size() for t in model.state_dict().values())
    index["tokenizer"] = index["tokenizer_2"] = [None, None]
    import diffusers

    diffusers.FlowMatchEulerDiscreteScheduler().save_pretrained(os.path.join(folder, "scheduler"))
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump(index, f)
    del models
    torch.cuda.empty_cache()
    return total


def run_one(method: str, spec: str, folder: str, steps: int, transformer_bytes: int, timeout_s: int) -> dict | str:
    budget = {"fifth": int(0.2 * transformer_bytes), "half": int(0.5 * transformer_bytes)}.get(spec, repr(spec))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ONE.format(root=root, steps=steps, method=method, spec=spec, folder=folder, budget=budget)
    one = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = one.communicate(timeout=timeout_s)
        ended = f"rc {one.returncode}"
    except subprocess.TimeoutExpired:  # (what it printed and where each thread stood say how far it came)
        one.send_signal(signal.SIGUSR1)
        try:  # (reads the stacks as they are written; the process goes on until killed)
            out, err = one.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        one.kill()
        out, err = one.communicate()
        ended = f"not done in {timeout_s} s"
    with open(out_path(f"bench_diffusion_folder_{method}{'_' + spec if spec else ''}.log"), "w") as f:
        f.write(out + "\n--- stderr\n" + err)  # (the whole of each process's output, pager's log in it)
    lines = out.splitlines()
    for line in lines:
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "ended": ended}
    stages = "; ".join(line[6:] for line in lines if line.startswith("STAGE ")) or "no stage reached"
    last = " | ".join(line[:160] for line in err.strip().splitlines()[-3:])
    return f"failed ({ended}): {stages}; {last}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="8GiB,fifth")
    ap.add_argument("--peers", default="model,block")
    ap.add_argument("--wrap", default="", help="budgets for diffusers' from_pretrained, then pager.wrap")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=240, help="seconds for each method's process")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_diffusion_folder needs CUDA: nothing to measure")
        return
    if not have_diffusers():
        return
    env = environment()
    print(env, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_FOLDER_DIR")) as folder:
        models = save_folder(folder)
        transformer = sum(
            os.path.getsize(os.path.join(folder, "transformer", f))
            for f in os.listdir(os.path.join(folder, "transformer"))
            if f.endswith(".safetensors")
        )
        work = f"FluxPipeline-shaped folder ({models / 1e9:.1f} GB of models), 1024x1024, {args.steps} steps"
        methods = [("pager", s) for s in args.budgets.split(",") if s]
        methods += [("wrap", s) for s in args.wrap.split(",") if s]
        methods += [(p, "") for p in args.peers.split(",") if p]
        for method, spec in methods:
            name = {"pager": f"pager.from_pretrained {spec}", "wrap": f"diffusers from_pretrained, pager.wrap {spec}",
                    "model": "diffusers enable_model_cpu_offload",
                    "block": "diffusers group offloading, block level, streams"}[method]  # fmt: skip
            got = run_one(method, spec, folder, args.steps, transformer, args.timeout)
            if isinstance(got, str):
                rows.append(Row(work, name, None, note=got))
            else:
                note = (
                    f"host RSS {got['rss_after'] / GiB:.1f} GiB after load ({got['rss_after'] / models:.2f}x the "
                    f"models), {got['rss_peak'] / GiB:.1f} GiB at its peak ({got['rss_peak'] / models:.2f}x); "
                    f"load {got['load_s']:.1f} s; first call {got['first_s']:.1f} s"
                    + (f"; budget {got['budget'] / GiB:.2f} GiB" if got["budget"] else "")
                    + (f"; the process then did not exit ({got['ended']})" if got["ended"].startswith("not") else "")
                )
                rows.append(Row(work, name, got["step_ms"], got["gpu_peak"] / GiB, note=note, extra=got))
            print(rows[-1], flush=True)
    save(rows, "bench_diffusion_folder", env)


if __name__ == "__main__":
    main()
