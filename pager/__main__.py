"""python -m pager plan <module:factory> --budget 10GiB [--device cuda] [--blocks A,B] [--inputs 4x1024:int64]
[--master-weights]

python -m pager --version"""

from __future__ import annotations

import argparse
import importlib
import sys


def main(argv=None) -> int:
    from . import __version__

    ap = argparse.ArgumentParser(prog="python -m pager")
    ap.add_argument("--version", action="version", version=f"pager {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="show what paging a model under a budget will do, before any GPU work")
    p.add_argument("factory", help="module:callable that returns the model, e.g. mypkg.models:build")
    p.add_argument("--budget", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--blocks", default=None, help="comma-separated class names of the blocks")
    p.add_argument("--state-factor", type=float, default=2.0)
    p.add_argument(
        "--master-weights",
        action="store_true",
        help="count float32 optimizer state and a float32 master for each bf16 parameter",
    )
    p.add_argument(
        "--inputs",
        default=None,
        help="a batch's shape and dtype, e.g. 4x1024:int64 (token ids) or 8x3x224x224 (float32): "
        "predict a training step's peak for each activations= policy",
    )
    args = ap.parse_args(argv)

    from . import plan

    module_name, _, attr = args.factory.partition(":")
    if not attr:
        ap.error(f"factory {args.factory!r} must be module:callable, e.g. mypkg.models:build")
    sys.path.insert(0, "")
    model = getattr(importlib.import_module(module_name), attr)()
    blocks = args.blocks.split(",") if args.blocks else None
    inputs = _batch(ap, args.inputs) if args.inputs else None
    result = plan(
        model,
        args.budget,
        device=args.device,
        blocks=blocks,
        state_factor=args.state_factor,
        inputs=inputs,
        master_weights=args.master_weights,
    )
    print(result)
    return 0 if result.runs else 1


def _batch(ap, spec: str):
    """A tensor of zeros from "4x1024:int64" (the dtype defaults to float32)."""
    import torch

    shape, _, dtype = spec.partition(":")
    try:
        dims = [int(d) for d in shape.split("x")]
    except ValueError:
        ap.error(f"--inputs {spec!r}: the shape must be sizes joined by x, e.g. 4x1024:int64")
    kind = getattr(torch, dtype or "float32", None)
    if not isinstance(kind, torch.dtype):
        ap.error(f"--inputs {spec!r}: {dtype!r} is not a torch dtype (e.g. int64, float32, bfloat16)")
    return torch.zeros(dims, dtype=kind)


if __name__ == "__main__":
    sys.exit(main())
