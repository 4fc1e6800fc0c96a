"""A diffusers pipeline under one budget: what `pager.wrap` does with a pipeline.

[Note: a pipeline under one budget]
A diffusion pipeline (diffusers' `DiffusionPipeline`: Flux, SD3, Wan) is no
module: it holds its models as components (text encoders, the transformer or
UNet, the VAE) beside tokenizers and a scheduler, and its `__call__` runs
them in turn: the text encoders once, the transformer at each of 20-50
denoising steps, the VAE once at the end. Paged one by one under budgets of
their own, each would keep its room while the others run. So `pager.wrap` of
a pipeline makes one `Pool` of the budget and wraps every `nn.Module`
component into it (named as the pipeline names it): the text encoders' blocks
are idle once denoising starts and leave as the transformer needs room, the
VAE's come in at the end, and the transformer's blocks stay or stream by the
room left ([Note: sharing the room] in engine/room.py: the kept set follows the
bytes each model used lately, so the denoising steps, one order repeated,
keep one set). Each component is wrapped as `pager.wrap` wraps a model, so
everything said of models holds of each; the pipeline's own code does not
change. Parameters stay the same objects: diffusers' `_execution_device`
(a component's parameter's device) names the pool's device.

A pipeline wrapped is all or nothing: a component that cannot be wrapped
(a budget too small for its least, offloading hooks of diffusers or
accelerate on it) unwraps the ones before it and raises, naming it. A
component wrapped already into the pool given (with options of its own,
`blocks=`) is taken as it is; one wrapped under another budget is refused.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch.nn as nn

from ..base.budget import format_bytes
from ..model.pool import Pool

# wrap's options that a pipeline takes: the pool's, and those given to each component's wrap
POOL_OPTIONS = ("device", "pin", "split_fetch")
COMPONENT_OPTIONS = ("prefetch", "trace_steps", "compress", "activations", "budget_covers")
_PIPELINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
log = logging.getLogger("pager")


class Needs(NamedTuple):
    """What a model wrapped into a pool needs on the device: what it holds for
    life, the least budget it runs in alone, and its largest block's name."""

    fixed_bytes: int
    least_bytes: int
    largest: str | None


class Verbs(NamedTuple):
    """pager's verbs for one model (api/wrap.py, which calls this module: it
    gives them, so that this module imports nothing above it); `needs(module,
    budget_bytes)`: its `Needs`, nothing changed."""

    wrap: Callable
    unwrap: Callable
    of: Callable
    needs: Callable


@dataclass
class WrappedPipeline:
    """A pipeline's pool and the components wrapped into it, in order."""

    pool: Pool
    names: list = field(default_factory=list)
    modules: list = field(default_factory=list)


def is_pipeline(obj) -> bool:
    """A diffusers pipeline, or an object shaped as one: no module, a `components` dict."""
    return not isinstance(obj, nn.Module) and isinstance(getattr(obj, "components", None), dict)


def wrap_pipeline(pipe, budget, pool, given: dict, verbs: Verbs):
    """Wrap every `nn.Module` component of `pipe` into one pool: `pool`, or
    one made of `budget` (see the Note). `given`: the options of `pager.wrap`
    the caller set (name -> value)."""
    kind = type(pipe).__name__
    if pipe in _PIPELINES:
        raise ValueError(f"pager: this {kind} is wrapped already; pager.unwrap(pipe) first to wrap it again.")
    other = sorted(set(given) - set(POOL_OPTIONS) - set(COMPONENT_OPTIONS))
    if other:
        raise ValueError(
            f"pager: wrap of a pipeline ({kind}) takes budget= or pool=, and "
            f"{', '.join(o + '=' for o in POOL_OPTIONS + COMPONENT_OPTIONS)}; {', '.join(o + '=' for o in other)} "
            "apply to one model: wrap that component alone into a pool "
            "(pager.wrap(pipe.transformer, pool=pool, ...)), then the others."
        )
    if pool is not None:
        if budget is not None:
            raise ValueError("pager: give budget= or pool=, not both (a pool's models share the pool's budget).")
        if set(given) & set(POOL_OPTIONS):
            names = ", ".join(o + "=" for o in sorted(set(given) & set(POOL_OPTIONS)))
            raise ValueError(f"pager: {names} belong to the pool: give them to pager.Pool(...).")
    elif budget is None:
        raise ValueError(f'pager: wrap of a pipeline ({kind}) needs budget= (e.g. budget="8GiB") or pool=.')
    made_here = pool is None
    if made_here:
        pool = Pool(budget, **{k: given[k] for k in POOL_OPTIONS if k in given})
    components = _components(pipe, pool, verbs.of)
    check_room(
        kind, pool, [(name, module) for name, module, joined in components if not joined], verbs, given=not made_here
    )
    wrapped = WrappedPipeline(pool)
    each = {k: given[k] for k in COMPONENT_OPTIONS if k in given}
    made = []  # (the modules wrapped here: undone on a failure)
    taken = {o.name for o in pool.engine.owners}
    try:
        for name, module, joined in components:
            if not joined:
                unique = free_name(name, taken)
                verbs.wrap(module, pool=pool, name=unique, **each)
                taken.add(unique)
                made.append(module)
            wrapped.names.append(name)
            wrapped.modules.append(module)
    except BaseException:
        undo(made, verbs)
        raise
    register(pipe, wrapped)
    return pipe


def check_room(kind: str, pool: Pool, new: list, verbs: Verbs, given: bool) -> None:
    """Refuse, before anything is wrapped (pinning a pipeline's pages takes
    seconds), a budget the pipeline cannot run in: what every model holds for
    life, and room beside it for the largest block any one needs
    (`Engine.least_budget` of the pool the wrap would make). `given`: the
    pool is the caller's (else made of budget=). (For models whose pages are
    read from files, their alignment there adds a few KiB a model: `pager.load`
    checks each as it comes.)"""
    engine = pool.engine
    needs = [(name, verbs.needs(module, engine.budget_bytes)) for name, module in new]
    held = engine.held_bytes() + sum(n.fixed_bytes for _name, n in needs)
    beside = [(o.min_budget_bytes - o.fixed_bytes(), o.name, None) for o in engine.owners]
    beside += [(n.least_bytes - n.fixed_bytes, name, n.largest) for name, n in needs]
    most, owner, block = max(beside, key=lambda b: b[0], default=(0, None, None))
    least = held + max(most, 0)
    if least <= engine.budget_bytes:
        return
    each = [f"{name} {format_bytes(n.fixed_bytes)}" for name, n in needs]
    if engine.owners:
        each.append(f"the pool's other models {format_bytes(engine.held_bytes())}")
    largest = f"{owner}'s block {block!r}" if block else f"{owner}'s largest block"
    least_text = format_bytes(least, up=True)
    raise ValueError(
        f"pager: this {kind} does not run in a budget of {format_bytes(engine.budget_bytes)}: its models need "
        f"{least_text} together: what each holds on the device for life ({', '.join(each)}) and, "
        f"beside it, {largest} with what it needs ({format_bytes(most)}). Raise the budget to "
        f"{least_text} or more{' (pool.set_budget(...))' if given else ''}; more still lets the next "
        "block come while one computes."
    )


def free_name(name: str, taken: set) -> str:
    """The pipeline's name for a component, or, where another model of the
    pool has it (a second pipeline of the same kind), `name.2`, `name.3`, ..."""
    k = 1
    while (f"{name}.{k}" if k > 1 else name) in taken:
        k += 1
    return f"{name}.{k}" if k > 1 else name


def undo(modules: list, verbs: Verbs) -> None:
    """A wrap of a pipeline that failed: unwrap the `modules` it wrapped (the
    last first); a failure in that is logged, the first error is the one raised."""
    try:
        unwrap_all(reversed(modules), verbs)
    except Exception:
        log.exception("pager: undoing the wrap of a pipeline that failed failed too; a component may be left wrapped")


def unwrap_all(modules, verbs: Verbs) -> None:
    """Unwrap each of `modules` still wrapped, whatever another's unwrap
    raises; then raise the first failure."""
    failed: BaseException | None = None
    for module in modules:
        try:
            verbs.of(module)
        except ValueError:
            continue  # (unwrapped by hand already)
        try:
            verbs.unwrap(module)
        except BaseException as e:  # (the others still go back)
            failed = failed or e
    if failed is not None:
        raise failed


def _components(pipe, pool: Pool | None, of: Callable) -> list:
    """(name, module, joined) of each `nn.Module` component, once each:
    `joined` where it is wrapped into `pool` already (taken as it is).
    Refused, before anything changes, where one is wrapped otherwise or
    carries offloading hooks."""
    kind, out, seen = type(pipe).__name__, [], set()
    for name, module in pipe.components.items():
        if not isinstance(module, nn.Module) or id(module) in seen:
            continue
        seen.add(id(module))
        out.append((name, module, joins(kind, name, module, pool, of)))
    if not out:
        raise ValueError(f"pager: this {kind} has no nn.Module component to page.")
    return out


def joins(kind: str, name: str, module: nn.Module, pool: Pool | None, of: Callable) -> bool:
    """Whether the component `name` of a `kind` pipeline is wrapped into
    `pool` already (taken as it is; else it is to be wrapped). Refused where
    it is wrapped under another budget or carries offloading hooks."""
    try:
        engine = of(module).engine
    except ValueError:
        engine = None
    if engine is not None:
        if pool is not None and engine is pool.engine:
            return True
        raise ValueError(
            f"pager: the component {name!r} of this {kind} is wrapped already, under a budget of its "
            "own; pager.unwrap it first, or wrap it into a pool and give the pipeline that pool "
            "(pager.wrap(pipe, pool=pool))."
        )
    hooked = _offload_hooks(module)
    if hooked:
        raise ValueError(
            f"pager: the component {name!r} of this {kind} has {hooked} hooks: both would move its "
            "weights. Call pipe.remove_all_hooks() (and leave enable_model_cpu_offload, "
            "enable_sequential_cpu_offload and enable_group_offload off) before pager.wrap(pipe)."
        )
    return False


def _offload_hooks(module: nn.Module) -> str | None:
    """Whose offloading hooks `module` carries: accelerate's (diffusers'
    model and sequential CPU offload) or diffusers' group offloading."""
    for m in module.modules():
        if hasattr(m, "_hf_hook"):
            return "accelerate's offloading"
        registry = getattr(m, "_diffusers_hook", None)
        if registry is not None and any("offload" in name for name in getattr(registry, "hooks", {})):
            return "diffusers' group offloading"
    return None


def register(pipe, wrapped: WrappedPipeline) -> None:
    """`pipe` is wrapped: its components `wrapped` (`pager.of`, `pager.unwrap`)."""
    _PIPELINES[pipe] = wrapped


def pipeline_pool(pipe) -> Pool:
    """The pool of a wrapped pipeline."""
    wrapped = _PIPELINES.get(pipe)
    if wrapped is None:
        raise ValueError(f"pager: this {type(pipe).__name__} is not wrapped; call pager.wrap(pipe, budget=...) first.")
    return wrapped.pool


def unwrap_pipeline(pipe, verbs: Verbs):
    """Unwrap every component of the wrapped pipeline (the last first), those it found in its pool too."""
    pipeline_pool(pipe)  # (refused where not wrapped)
    wrapped = _PIPELINES.pop(pipe)
    unwrap_all(reversed(wrapped.modules), verbs)
    return pipe


def given_options(wrap, values: dict) -> dict:
    """`wrap`'s options that `values` (its arguments) sets otherwise than
    its defaults, by name (a pipeline's components get those)."""
    out = {}
    for n, p in inspect.signature(wrap).parameters.items():
        if p.default is inspect.Parameter.empty or n in ("budget", "pool"):
            continue
        v = values[n]
        if not (v is p.default or (type(v) is type(p.default) and v == p.default)):
            out[n] = v
    return out
