"""Every benchmark: forward (with the compute-bound case), the budget sweep
and its plot, training (decoder vs peers, NAS supernet), what
transparency costs (clip, GradScaler, on-demand access), and Hugging Face
decode with the host time per block use, one model over several GPUs'
links (`split`, on machines with two or more), and a 7B-shaped bf16 full
fine-tune (`finetune`: a host of 128 GiB) with its host update by part
(`host_update`). Results land in $OUT
(or .). All of it takes longer than one 10-minute device call: split it.

    python -m benchmarks.run_all --skip transparency,generate   # ~9 min
    python -m benchmarks.run_all --skip forward,sweep,train          # ~5 min

Peers that are not installed are skipped and say so. To install the wheels
fetched by ../shared/tools/peer-wheels.sh into .peers/:
    python3 -m pip install --no-deps -q --target /tmp/peers .peers/*.whl
    PYTHONPATH=/tmp/peers python -m benchmarks.run_all
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

STEPS = {
    "forward": ["-m", "benchmarks.bench_forward", "--compute-bound"],
    "sweep": ["-m", "benchmarks.bench_sweep"],
    "train": ["-m", "benchmarks.bench_train"],
    "transparency": ["-m", "benchmarks.bench_transparency"],
    "generate": ["-m", "benchmarks.bench_generate", "--batches", "1,8", "--compress", "none", "--reps", "2"],
    "lora": ["-m", "benchmarks.bench_lora"],
    "compile": ["-m", "benchmarks.bench_compile"],
    "quantized": ["-m", "benchmarks.bench_quantized"],
    "split": ["-m", "benchmarks.bench_split"],  # (skips itself with fewer than two GPUs)
    # (5.1B parameters: each system's host copy is 89-120 GiB, in turn)
    "finetune": ["-m", "benchmarks.bench_finetune", "--systems", "pager,torchao32,deepspeed", "--budgets", "16"],
    "host_update": ["-m", "benchmarks.bench_host_update"],  # (the host's share of "finetune", by part)
}
# seconds (measured ~75, ~110, ~260, ~100, ~200, ~160, ~180)
LIMITS = {"forward": 120, "sweep": 170, "train": 300, "transparency": 170, "generate": 300, "lora": 300,
          "compile": 300, "quantized": 300, "split": 300, "finetune": 540,
          "host_update": 120}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", default="")
    args = ap.parse_args()
    out = os.environ.get("OUT") or "."
    failed = []
    for name, cmd in STEPS.items():
        if name in args.skip.split(","):
            continue
        print(f"== {name}", flush=True)
        try:
            subprocess.run([sys.executable, *cmd], check=True, timeout=LIMITS[name])
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            print(f"== {name} did not finish: {e}", flush=True)
            failed.append(name)
    sweep = os.path.join(out, "sweep.json")
    if os.path.exists(sweep):
        subprocess.run([sys.executable, "-m", "benchmarks.plot", sweep, os.path.join(out, "budget.png")])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
