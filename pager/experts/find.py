"""Which modules are a mixture's experts, paged one expert at a time
([Note: experts paged one by one] in experts/table.py).

An experts module holds every expert's weights in tensors whose first
dimension is the expert (transformers 5's fused `gate_up_proj` and
`down_proj`, and their biases) and is called with the routing:
`forward(hidden_states, top_k_index, top_k_weights)` (GPT-OSS's:
`router_indices, routing_weights`), `num_experts` its number of experts. That is the convention of transformers'
`use_experts_implementation` classes (Mixtral, Qwen2/3-MoE, DeepSeek-V3,
GPT-OSS, ...), and of any module written to it.
"""

from __future__ import annotations

import inspect
from typing import cast

import torch.nn as nn


def experts_problem(module: nn.Module) -> str | None:
    """Why `module` cannot be paged by expert (None: it can)."""
    params = list(module._parameters.values())
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        return "it has no `num_experts` attribute of 2 or more"
    if not params or any(p is None or p.dim() < 1 or p.shape[0] != n for p in params):
        return f"not every parameter of its own has the {n} experts as its first dimension"
    if any(t is not None for t in module._buffers.values()):
        return "it has buffers"
    if any(t is not None for m in module.children() for t in list(m.parameters()) + list(m.buffers())):
        return "a module inside it holds tensors"
    if any(type(p) is not nn.Parameter or not p.is_floating_point() for p in params):
        return "a parameter is a tensor subclass (quantized) or not floating point"
    if routing_name(module) is None:
        return f"its forward takes no {' or '.join(f'`{n}`' for n in ROUTING_NAMES)} (the routing)"
    return None


ROUTING_NAMES = ("top_k_index", "router_indices")  # (GPT-OSS's experts name it the latter)


def _forward_args(module: nn.Module) -> list:
    """The names of `module`'s forward arguments, in order (none if it has no signature)."""
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def hidden_name(module: nn.Module) -> str | None:
    """The name of the hidden states' argument of `module`'s forward (its first)."""
    names = _forward_args(module)
    return names[0] if names else None


def routing_name(module: nn.Module) -> str | None:
    """The name of the routing argument of `module`'s forward (its second)."""
    names = _forward_args(module)
    return names[1] if len(names) > 1 and names[1] in ROUTING_NAMES else None


def weights_name(module: nn.Module) -> str | None:
    """The name of the routing weights' argument of `module`'s forward (its third)."""
    names = _forward_args(module)
    return names[2] if len(names) > 2 else None


def choose(model: nn.Module, experts, training_group: bool = False) -> list:
    """(qualified name, module) of each experts module to page by expert.

    Args:
        model: the model being wrapped.
        experts: "auto" (every module of the convention), None or [] (none), or
            a list of modules or qualified names, each of which must be one.
        training_group: a process group trains the model: "auto" is none
            (experts paged one by one are not averaged over ranks yet).
    """
    if experts is None or (isinstance(experts, (list, tuple)) and not experts):
        return []
    if experts == "auto" and training_group:
        return []
    if experts == "auto":
        return [(n, m) for n, m in model.named_modules() if m is not model and experts_problem(m) is None]
    if not isinstance(experts, (list, tuple)):
        raise ValueError(
            f'pager: experts={experts!r} must be "auto" (every experts module), None (none) or a list of '
            "experts modules or their qualified names."
        )
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    out = []
    for item in experts:
        name = item if isinstance(item, str) else names.get(id(item))
        module = modules.get(name) if name is not None else None
        if module is None:
            raise ValueError(f"pager: experts= names {item!r}, which is not a module of this model.")
        problem = experts_problem(module)
        if problem is not None:
            raise ValueError(
                f"pager: experts= names {name!r} (a {type(module).__name__}), which cannot be paged by expert: "
                f"{problem}. Leave it out of experts= to page it with its layer."
            )
        out.append((name, module))
    return out


def layout_of(module: nn.Module) -> tuple:
    """What makes experts modules share a cache: each parameter's shape of one expert, and dtype."""
    return tuple((tuple(p.shape[1:]), p.dtype) for p in module._parameters.values() if p is not None)


def expert_bytes(module: nn.Module) -> int:
    """Bytes of one expert of an experts module (its slice of every parameter)."""
    return sum(p[0].numel() * p.element_size() for p in module._parameters.values() if p is not None)


def routed_of(module: nn.Module) -> int:
    """The experts one token routes to in `module`: the model's top k, where
    its config says it; else every expert."""
    k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    count = int(cast(int, module.num_experts))
    return min(k, count) if isinstance(k, int) and k > 0 else count


def implementation_of(module: nn.Module) -> str | None:
    """transformers' experts implementation `module` runs under (its config's), if any."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None)
