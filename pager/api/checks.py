"""What `wrap` checks and works out before it changes anything: the options
against each other and the process group, the model's tensors, the engine
to join, the room rows and staging take. Each check raises naming the
option, the value and the fix.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ..base import wrappers
from ..base.budget import format_bytes, parse_budget, resolve_device
from ..base.common import _PAGERS
from ..engine.engine import Engine
from ..engine.host import COPY_SECONDS_PER_GIB, PIN_PROGRESS_BYTES, PIN_SECONDS_PER_GIB
from ..engine.split_fetch import helper_budgets, resolve_helpers
from ..experts.find import expert_bytes, layout_of, routed_of
from ..experts.host import COLD_EXPERTS
from ..model.pool import Pool
from ..training import distributed, host_step, masters, owners
from .fit import too_large_message

log = logging.getLogger("pager")


def check_master_tables(tables: list) -> None:
    """A row table updates its rows in its own dtype ([Note: exact updates
    of touched rows] in rows/table.py): under master_weights a bf16 one
    would be the exception, so it is refused."""
    for name, module in tables:
        if masters.wants_master(module.weight):
            raise ValueError(
                f"pager: master_weights=True, but the embedding table {name!r} ({module.weight.dtype}) is paged by "
                f"rows, whose updates run in the table's own dtype. Give it float32, a budget that holds it beside "
                f"a block (it then pages as a block, with masters), or rows=[] to page it as a block."
            )


# [Note: one script from 1 to N GPUs]
# `block_owners=True` and `share_host_pages=True` share work and host memory
# between the ranks of a node. A script written for `torchrun` runs them on
# one GPU too (plain `python`, or one rank): there is nothing to share, which
# is said once at INFO, and the model trains as a single process does (a
# test checks bit for bit). Only `process_group=False` beside them is
# refused: the caller turned off the ranks that they need.
def sharing(block_owners, share_host_pages, group, process_group, model, pages_from_plan: bool) -> tuple[bool, bool]:
    """`block_owners` and `share_host_pages` as they apply: checked, sharing
    implied by owners, and both off with one process ([Note: one script
    from 1 to N GPUs]). `pages_from_plan`: neither `compress=` nor `pager.load`."""
    for name, value in (("block_owners", block_owners), ("share_host_pages", share_host_pages)):
        if not isinstance(value, bool):
            raise ValueError(f"pager: {name}={value!r} must be True or False.")
    if not (block_owners or share_host_pages):
        return False, False
    if process_group is False:
        what = (
            "block_owners=True shares the blocks' optimizer updates"
            if block_owners
            else "share_host_pages=True shares the weights' host pages"
        )
        raise ValueError(
            f"pager: {what} between the ranks of a node, and process_group=False turns the ranks off; leave "
            "one of them out."
        )
    if not pages_from_plan:
        raise ValueError(
            "pager: share_host_pages=True is not supported with compress= or with pager.load "
            "(their pages are not laid out as the plan); wrap without one of them."
        )
    if group is None:
        log.info(
            "pager: %s with one process (torch.distributed not initialized, or one rank): nothing to share; "
            "the model trains as a single process does.",
            "block_owners=True" if block_owners else "share_host_pages=True",
        )
        return False, False
    if block_owners:
        owners.check_model(model)
    return block_owners, True


def links(helpers, engine) -> int:
    """The links a fetch goes over: the device's own and its helpers' (a pool's, if it shares one)."""
    split = engine.transport.split if engine is not None else None
    return 1 + (len(split.helpers) if split is not None else len(helpers))


def split_helpers(split_fetch, device, pin, engine, group, budget_bytes: int) -> list:
    """The helper GPUs of `split_fetch=` ([Note: split fetch] in engine/split_fetch.py), checked, each
    with the bytes it may hold."""
    if split_fetch is None:
        return []
    if engine is not None:
        raise ValueError(
            "pager: split_fetch= belongs to the budget's engine: this model shares one (pool= or "
            "budget=<engine>). Give split_fetch to pager.Pool(...) or to the first model's wrap."
        )
    if group is not None:
        raise ValueError(
            "pager: split_fetch= lends other GPUs' links to this one; with a process group each "
            "rank's GPU streams its own blocks over its own link already. Leave split_fetch out, or "
            "pass process_group=False for one process that streams over several GPUs."
        )
    helpers = resolve_helpers(split_fetch, device, pin)
    return list(zip(helpers, helper_budgets(split_fetch, helpers, budget_bytes)))


def check_data_parallel(model, group, tables, experts, timeout, device, broadcast: bool) -> None:
    """Refuse what data parallelism cannot do, before anything changes; then
    give every rank rank 0's weights (unless they come from one checkpoint)."""
    if tables:
        raise ValueError(
            "pager: rows= (row-paged embedding tables) is not supported with a process group yet: "
            "their sparse updates are not averaged over the ranks. Leave the tables to blocks "
            "(rows=None) for data-parallel training."
        )
    if experts:
        raise ValueError(
            f"pager: experts= names {experts[0][0]!r}, but the gradients of experts paged one by one are not "
            "averaged over a process group's ranks yet. Leave experts= out (they then page with their layer)."
        )
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"pager: dist_timeout={timeout!r} must be a number of seconds > 0.")
    if (
        device.type == "cuda"
        and not distributed.control_on_cpu(group)
        and device != torch.device("cuda", torch.cuda.current_device())
    ):
        raise ValueError(
            f"pager: this rank pages onto {device} but its current CUDA device is "
            f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device(local_rank) first."
        )
    distributed.check_same_model(model, group, timeout, device)
    if broadcast:
        distributed.broadcast_from_first(model, group, device, timeout)


def engine_of(budget, pool) -> Engine | None:
    """The engine a new model joins (a pool's, another model's), or None for a budget of its own."""
    if pool is not None:
        if not isinstance(pool, Pool):
            raise ValueError(
                f"pager: pool= takes a pager.Pool, not a {type(pool).__name__}; make one with pager.Pool(budget=...)."
            )
        if budget is not None:
            raise ValueError(
                "pager: give budget= or pool=, not both (a pool's models share the pool's budget; "
                "change it with pool.set_budget(...))."
            )
        return pool.engine
    if budget is None:
        raise ValueError('pager: wrap needs budget= (e.g. budget="10GiB") or pool= (a pager.Pool to share).')
    return budget if isinstance(budget, Engine) else None


def shared_device(engine: Engine, device) -> torch.device:
    """The device of a shared engine; `device`, if given, must be it."""
    if not engine.owners and engine.pool is None:
        raise ValueError(
            "pager: budget= got the engine of a model that was unwrapped; pass "
            "pager.of(model).engine of a model that is still wrapped, or a budget."
        )
    if device is not None and resolve_device(device) != engine.device:
        raise ValueError(
            f"pager: budget= shares an engine on {engine.device}, but this model runs on {device}; "
            f"pass device={str(engine.device)!r} (or leave device out) to share it."
        )
    return engine.device


def check_not_wrapped(model: nn.Module) -> None:
    if model in _PAGERS:
        raise ValueError("pager: this model is already wrapped; call pager.unwrap(model) before wrapping it again.")
    mine = {id(m) for m in model.modules()}
    for other in list(_PAGERS.keys()):
        if any(m is model for m in other.modules()):
            raise ValueError(
                f"pager: this {type(model).__name__} is a submodule of a wrapped "
                f"{type(other).__name__}; it is paged with it already (unwrap the outer model first)."
            )
        if id(other) in mine:
            raise ValueError(
                f"pager: this {type(model).__name__} contains a wrapped {type(other).__name__}; "
                f"unwrap the inner model first, then wrap the outer one."
            )


def check_tensors(model: nn.Module, device: torch.device) -> None:
    devices = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise ValueError(
                f"pager: {name!r} is on the meta device (no data); materialize the model first "
                f"(e.g. model.to_empty(device='cpu') and load its weights)."
            )
        if t.layout != torch.strided:
            raise ValueError(
                f"pager: {name!r} has layout {t.layout}; pager pages dense tensors only. Keep this "
                f"module out of the blocks or convert it to dense."
            )
        problem = wrappers.refusal(name, t)
        if problem is not None:
            raise ValueError(problem)
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(
            f"pager: the model's tensors are on several devices ({sorted(map(str, devices))}); "
            f"move it to one device (e.g. model.cpu()) before wrapping."
        )
    bad = {d for d in devices if d.type not in ("cpu", device.type)}
    if bad:
        raise ValueError(f"pager: the model is on {bad.pop()}; move it to the CPU or to {device} first.")


def row_cache_bytes(row_cache, device, budget_bytes: int, min_budget: int) -> int:
    """Device bytes for the row tables' caches: `row_cache`, or a quarter of
    the budget at most what the blocks leave."""
    if row_cache is None:
        return max(0, min(budget_bytes // 4, budget_bytes - min_budget))
    if isinstance(row_cache, int) and not isinstance(row_cache, bool) and row_cache == 0:
        return 0
    try:
        nbytes = parse_budget(row_cache, device)
    except ValueError as e:
        raise ValueError(str(e).replace("budget=", "row_cache=", 1)) from None
    if min_budget + nbytes > budget_bytes:
        raise ValueError(
            f"pager: row_cache={row_cache!r} ({format_bytes(nbytes)}) and the {format_bytes(min_budget)} the "
            f"blocks need at least exceed the budget ({format_bytes(budget_bytes)}); give row_cache of at most "
            f"{format_bytes(max(0, budget_bytes - min_budget))}, or raise the budget."
        )
    return nbytes


def expert_cache_bytes(expert_cache, device, budget_bytes: int, sizing, row_bytes: int, modules: list) -> int:
    """Device bytes for the experts' caches ([Note: experts paged one by
    one] in experts/table.py): `expert_cache`, or what the budget has beyond
    the rest of the model (all of it on the device, as far as it goes), the
    row tables' caches and an eighth of the budget (activations, a KV cache);
    at least the experts one token routes to in every module (a call that
    routes to more than its cache holds runs by chunks of tokens), at most
    all experts. Refused, naming the least budget, where the budget cannot
    hold that least beside what the blocks need."""
    layouts: dict = {}
    for _n, m in modules:
        key, per = layout_of(m), expert_bytes(m)
        most, total = layouts.get(key, (0, 0))
        layouts[key] = (max(most, per * routed_of(m)), total + per * m.num_experts)
    every = sum(total for _m, total in layouts.values())
    # (the caches of layouts share the bytes in proportion to their experts': each share holds its most)
    least = max(-(-most * every // total) for most, total in layouts.values())
    blocks = sizing.min_budget + row_bytes
    if expert_cache is None:
        nbytes = min(every, max(least, budget_bytes - sizing.total - row_bytes - budget_bytes // 8))
        nbytes = min(nbytes, max(least, budget_bytes - blocks))
    else:
        try:
            nbytes = parse_budget(expert_cache, device)
        except ValueError as e:
            raise ValueError(str(e).replace("budget=", "expert_cache=", 1)) from None
        nbytes = min(nbytes, every)
    if nbytes < least or blocks + nbytes > budget_bytes:
        name = next(n for n, _m in modules)
        raise ValueError(
            f"pager: the experts paged one by one ({len(modules)} modules, such as {name!r}) need a cache of "
            f"{format_bytes(least)} at least (the experts a token routes to), beside the "
            f"{format_bytes(blocks)} the rest of the model needs at least; "
            + (f"expert_cache={expert_cache!r} gives {format_bytes(nbytes)} and " if expert_cache is not None else "")
            + f"the budget is {format_bytes(budget_bytes)}. Raise the budget to "
            f"{format_bytes(blocks + least, up=True)} or more, or give experts=None to page the experts with "
            "their layers."
        )
    return nbytes


def warn_if_staging_crowds(pager) -> None:
    """Compressed pages' staging ring comes out of the budget; if what is left
    cannot hold the largest block, the block runs anyway (over the budget)."""
    staging = pager.transport.staging_bytes
    if staging and pager.budget_bytes - staging < pager.min_budget_bytes:
        log.warning(
            "pager: the staging ring of compressed pages (%s) leaves %s of the %s budget, less than the %s the "
            "largest block needs beside the remainder; it runs over the budget by up to %s. Raise the budget to "
            "%s or more.",
            format_bytes(staging),
            format_bytes(pager.budget_bytes - staging),
            format_bytes(pager.budget_bytes),
            format_bytes(pager.min_budget_bytes),
            format_bytes(pager.min_budget_bytes + staging - pager.budget_bytes),
            format_bytes(pager.min_budget_bytes + staging),
        )


def check_fits(budget, budget_bytes, sizing, model) -> None:
    if sizing.min_budget > budget_bytes:
        raise ValueError(too_large_message(budget, budget_bytes, sizing, model))


def check_options(model, device, engine, name, prefetch, defer_step, master_weights, optimizer_step) -> None:
    """`wrap`'s plain options and the model's state, checked before anything changes."""
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"pager: name={name!r} must be a non-empty string.")
    if name is not None and engine is not None and any(o.name == name for o in engine.owners):
        raise ValueError(f"pager: name={name!r} is taken by another model of this pool; give another.")
    check_not_wrapped(model)
    check_tensors(model, device)
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"pager: prefetch={prefetch!r} must be a whole number >= 0 (0 turns prefetch off).")
    if not isinstance(defer_step, bool):
        raise ValueError(f"pager: defer_step={defer_step!r} must be True or False.")
    if not isinstance(master_weights, bool):
        raise ValueError(f"pager: master_weights={master_weights!r} must be True or False.")
    if optimizer_step not in host_step.MODES:
        raise ValueError(
            f'pager: optimizer_step={optimizer_step!r} must be "auto" (on the host where it is '
            'measured to keep up, else on the device), "host" (the CPU) or "device".'
        )


def check_modes(cold_experts, activations) -> None:
    """`wrap`'s `cold_experts` and `activations`, checked before anything changes."""
    if cold_experts not in COLD_EXPERTS:
        raise ValueError(
            f'pager: cold_experts={cold_experts!r} must be "auto" (on CUDA, of the experts a call routes to '
            "that the device cache lacks, the host computes as many as it can in the time the rest take to "
            'copy in, by measured cost), "host" (every such expert of a few tokens computed on the host) or '
            '"device" (every one copied in).'
        )
    if activations not in ("keep", "offload", "recompute", "auto"):
        raise ValueError(
            f'pager: activations={activations!r} must be "keep" (on the device), "offload" '
            '(to pinned host memory until the backward), "recompute" (dropped, and each block\'s '
            'forward run again in its backward) or "auto" (kept on the device as far as the budget has room, '
            "the rest offloaded or recomputed, the first the budget holds, decided before the first training "
            "forward from it measured on fake tensors)."
        )


def held_beside(engine, min_budget: int) -> int:
    """What the other models of a shared `engine` hold for life and in
    caches (0 alone); refused where a model needing `min_budget` at least
    does not fit beside it."""
    if engine is None:
        return 0
    held = engine.held_bytes()
    if held + min_budget > engine.budget_bytes:
        raise ValueError(
            f"pager: this model needs {format_bytes(min_budget)} of device memory at least (its remainder "
            f"and largest block), but the shared {engine!r} has {format_bytes(held)} of its "
            f"budget held for life and in caches by the models on it; raise that budget "
            f"(pager.of(other).set_budget(...)) first."
        )
    return held


def before_paging(pager, total: int, blocks: int, adapter_bytes: int, from_memory: bool) -> None:
    """Before the blocks' pages are made: host memory for `total` bytes of
    `blocks` blocks checked where they are copied `from_memory`, and what
    takes a while or stays on the device said."""
    if from_memory:
        pager.arena.check_room(total, f"the model ({blocks} blocks)")
    if total >= PIN_PROGRESS_BYTES and from_memory:
        kind, seconds = ("pinned", PIN_SECONDS_PER_GIB) if pager.arena.pin else ("pageable", COPY_SECONDS_PER_GIB)
        log.warning(
            "pager: copying %s into %s host pages for %d blocks; wrap takes about %.0f s",
            format_bytes(total),
            kind,
            blocks,
            seconds * total / 2**30,
        )
    if adapter_bytes:
        log.info(
            "pager: the trainable parameters of otherwise frozen blocks (adapters, %s) stay on the device "
            "with their gradients and optimizer state; their blocks stream read-only.",
            format_bytes(adapter_bytes),
        )
