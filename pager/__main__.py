"""python -m pager plan <module:factory> --budget 10GiB [--device cuda] [--blocks A,B]
[--inputs 4x1024:int64 | --inputs input_ids=4x1024:int64 [--inputs NAME=SHAPE:DTYPE ...] [--labels]]
[--optimizer AdamW] [--state-factor 2] [--master-weights]

Exit status: 0 where the budget runs and, when a training step is planned
(`--inputs` or `--optimizer`), trains with the defaults; 1 where it does not;
2 for a usage error (`--optimizer` without `--inputs` included: without the
forward's inputs activations are not counted, and whether it trains is not
known).

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
    p = sub.add_parser(
        "plan",
        help="show what paging a model under a budget will do, before any GPU work",
        description="Exit status: 0 where the budget runs and, when a training step is planned (--inputs or "
        "--optimizer), trains with the defaults; 1 where it does not; 2 for a usage error.",
    )
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
        action="append",
        default=None,
        metavar="[NAME=]SHAPE[:DTYPE]",
        help="an input of the forward: its shape and dtype, e.g. 4x1024:int64 (token ids) or 8x3x224x224 "
        "(float32), positional, or named as the forward's keyword argument, e.g. input_ids=4x1024:int64; "
        "repeat it for each argument (all positional or all named). Plans a training step: predicts its peak "
        "for each activations= policy and the least budget that trains (exit status 1 below it)",
    )
    p.add_argument(
        "--labels",
        action="store_true",
        help="pass the input named input_ids as labels= too (a causal LM's loss over its own tokens, which a "
        "Hugging Face model computes inside its forward: what it saves counts)",
    )
    p.add_argument(
        "--optimizer",
        default=None,
        metavar="NAME",
        help="the torch.optim class that trains the model, e.g. AdamW or SGD (built on its parameters with "
        "its defaults): the state it keeps is counted, instead of --state-factor; needs --inputs",
    )
    p.add_argument(
        "--budget-covers",
        choices=("pager", "process"),
        default="process",
        help='as wrap(budget_covers=): "process" counts what the process holds outside pager (the inputs, '
        "the output, the loss's backward, predicted from --inputs) in the least budget that trains",
    )
    args = ap.parse_args(argv)

    import torch

    from . import plan

    module_name, _, attr = args.factory.partition(":")
    if not attr:
        ap.error(f"factory {args.factory!r} must be module:callable, e.g. mypkg.models:build")
    inputs = _inputs(ap, args.inputs or [], args.labels)
    optimizer_class = None
    if args.optimizer is not None:
        optimizer_class = getattr(torch.optim, args.optimizer, None)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            ap.error(f"--optimizer {args.optimizer!r} is not a torch.optim optimizer (e.g. AdamW, Adam, SGD)")
        if inputs is None:
            ap.error(
                "--optimizer plans a training step, whose least budget counts the activations its forward "
                "saves: give the forward's inputs too, e.g. --inputs input_ids=4x1024:int64 --labels"
            )
    sys.path.insert(0, "")
    model = getattr(importlib.import_module(module_name), attr)()
    try:
        optimizer = optimizer_class(model.parameters()) if optimizer_class is not None else None
        result = plan(
            model,
            args.budget,
            device=args.device,
            blocks=args.blocks.split(",") if args.blocks else None,
            state_factor=args.state_factor,
            inputs=inputs,
            optimizer=optimizer,
            master_weights=args.master_weights,
            budget_covers=args.budget_covers,
        )
    except (ValueError, TypeError) as e:  # (a plan or an optimizer these arguments cannot make)
        print(e, file=sys.stderr)
        return 2
    print(result)
    if inputs is None:  # (inference alone: the training figure is a lower bound, said in the text)
        return 0 if result.runs else 1
    return 0 if result.runs and result.trains else 1


def _inputs(ap, specs: list, labels: bool):
    """What `plan(inputs=)` takes from the `--inputs` given: None, one tensor,
    a tuple of them (positional) or a dict (named), with `labels` the
    tensor named input_ids (the same tensor, as a causal LM's step passes it)."""
    named = [s.partition("=") for s in specs if "=" in s]
    if named and len(named) != len(specs):
        ap.error("--inputs: give every input positional (4x1024:int64) or every one named (input_ids=4x1024:int64)")
    if labels and "input_ids" not in {name for name, _, _ in named}:
        ap.error("--labels passes the input named input_ids as labels: give it as --inputs input_ids=4x1024:int64")
    if named:
        batch = {}
        for name, _, spec in named:
            if not name.isidentifier() or name in batch:
                ap.error(f"--inputs {name}={spec}: {name!r} is not a keyword argument's name, or is given twice")
            batch[name] = _batch(ap, spec)
        if labels:
            if "labels" in batch:
                ap.error("--labels: labels is given with --inputs already")
            batch["labels"] = batch["input_ids"]
        return batch
    if not specs:
        return None
    tensors = tuple(_batch(ap, s) for s in specs)
    return tensors[0] if len(tensors) == 1 else tensors


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
