"""What a training step of a wrapped model needs on the device beside its
activations: each block's pages with the gradients and optimizer state still
to come, and the least of them that runs. `Activations` chooses its policy
and refuses a budget from these ([Note: activations, the automatic choice]
in training/activations.py); a scan of the blocks, once a step."""

from __future__ import annotations

import logging

from ..base.budget import format_bytes
from ..base.common import LEAST_MOVED_BYTES, WEIGHTS
from ..base.registry import unguarded
from ..base.wrappers import aligned_bytes
from ..experts.cache import caches_of, shrink_caches
from ..experts.table import MOST_COPIED_SHARE
from ..observe.report import ASSUMED_LINK_GBPS, PROBED_DTYPES, measure_matmul_flops
from ..training.dry_run import measure_saved, state_bytes_of
from ..training.saved_bytes import Speeds

log = logging.getLogger("pager")


def train_bytes(pager) -> dict:
    """Each block's pages in a training step: its weights, and its trainable
    parameters' gradients and the attached optimizer's state (none before one
    is attached; a row table's stay on the host: its cache is `row_bytes`),
    those that exist or the estimate, whichever is more."""
    optimizer = pager.optimizers[0].optimizer if pager.optimizers else None
    state_factor = 2.0 if optimizer is not None else 0.0  # (its class decides; none attached yet: none)
    state_of = state_bytes_of(optimizer, pager.device, state_factor, master_weights=pager.master_weights)
    rows = pager.row_params
    # (sizes and flags read past the guards: a paged-out tensor's are its own, and a guard's
    # serving of each costs more than the read; every parameter of every block, at each step)
    with unguarded():
        trained = {
            b: sum(aligned_bytes(p) + state_of(p) for p in b.params if p.requires_grad and id(p) not in rows)
            for b in pager.all_blocks()
        }
    return {b: max(b.nbytes(), b.nbytes(WEIGHTS) + n) for b, n in trained.items()}


def least_room_bytes(pager) -> int:
    """The least room for blocks that runs now: what stays resident, and
    the largest block with the blocks it borrows from, each with every
    segment it has (gradients and optimizer state, once they exist)."""
    fixed = pager.fixed_bytes()
    largest = max(
        (b.nbytes() + sum(d.nbytes() for d in b.deps) for b in pager.blocks if not b.resident_for_life), default=0
    )
    return max(fixed + largest, pager.min_budget_bytes)


def least_bytes(pager) -> int:
    """`least_room_bytes` with the gradients and optimizer state still to
    come counted, and the state a forward carries and the row caches held
    beside the blocks."""
    size = train_bytes(pager)
    fixed = sum(size[b] for b in pager.all_blocks() if b.resident_for_life)
    largest = max((size[b] + sum(size[d] for d in b.deps) for b in pager.blocks if not b.resident_for_life), default=0)
    return max(fixed + largest, pager.min_budget_bytes) + pager.carried_bytes + pager.row_bytes


def remainder_said(pager) -> str:
    """Where the remainder, with its gradients and optimizer state, is a
    quarter or more of what blocks need at least in a training step, and
    modules outside every block keep it there (each under LEAST_MOVED_BYTES
    stays unasked: [Note: nothing resident by force] in api/fit.py), a
    clause for a refusal that names the largest of them and says how to page
    them; else "". (Not what stays inside a block's module: adapters kept on
    the device, [Note: adapters stay on the device] in model/discover.py.)"""
    remainder = pager.remainder
    if remainder is None:
        return ""
    fixed = train_bytes(pager)[remainder]
    if 4 * fixed < least_bytes(pager):
        return ""
    ids = {id(p) for p in remainder.params}
    inside = {id(m) for b in pager.blocks if b.module is not None for m in b.module.modules()}
    named, said = [], set()  # (a weight tied into two modules: named once)
    with unguarded():  # (sizes of tensors that may be paged out: their own)
        for name, module in pager.model.named_modules():
            if not name or id(module) in inside:
                continue
            own = [p for p in module._parameters.values() if p is not None and id(p) in ids and id(p) not in said]
            said |= {id(p) for p in own}
            nbytes = sum(aligned_bytes(p) for p in own)
            if own and nbytes < LEAST_MOVED_BYTES:
                named.append((nbytes, name))
    if not named:
        return ""
    named.sort(key=lambda r: -r[0])
    named = [(b, n) for b, n in named if 8 * b >= named[0][0]]  # (not a norm's few bytes beside an embedding)
    listed = " and ".join(f"{n!r} ({format_bytes(b)})" for b, n in named[:4])
    listed += " among others" if len(named) > 4 else ""
    return (
        f"; of it, the remainder holds {format_bytes(fixed)} on the device for life with its gradients and "
        f"state: {listed} stay in it, as a module outside the layers leaves it by itself only from "
        f"{format_bytes(LEAST_MOVED_BYTES)}; `blocks=` listing the layers and those modules pages them too"
    )


def update_bytes(pager) -> int:
    """The most an update of one block on the device holds beyond its pages
    ([Note: the step's room] in training/step_room.py): at the step, in
    place of the activations' room; none before an optimizer is attached."""
    if not pager.optimizers:
        return 0
    link = pager.optimizers[0]
    trained = {id(p) for params in link.group_params() for p in params}
    return max((link.step_room.update_bytes(b, trained) for b in pager.all_blocks()), default=0)


def beside_bytes(pager, budget: int | None = None) -> int:
    """What a training pass holds beside its activations that pager bounds,
    under `budget` (None: the budget as given): its experts' calls' copies,
    two at once in a backward (experts/table.py's share of the budget each)."""
    if not pager.expert_tables:
        return 0
    return 2 * ((pager.engine.budget_bytes if budget is None else budget) // MOST_COPIED_SHARE)


def give_back(pager, nbytes: int) -> int:
    """Give at least `nbytes` of the experts' caches' device memory back to
    a training step the budget would not hold otherwise, the caches no
    smaller than a token's experts; returns the bytes given."""
    caches = caches_of(pager.expert_tables)
    freed = shrink_caches(caches, nbytes)
    if freed:
        pager.row_bytes -= freed
        log.info(
            "pager: the experts' caches gave %s to the training step (now %s): the blocks with their gradients "
            "and optimizer state, and the activations, need it in this budget",
            format_bytes(freed),
            format_bytes(sum(c.device_bytes() for c in caches)),
        )
    return freed


def pages_to_come_bytes(pager) -> int:
    """What the gradients and optimizer state not made yet will add to the blocks' pages."""
    return sum(n - b.nbytes() for b, n in train_bytes(pager).items())


LINK_SEEN_BYTES = 256 << 20  # copies that give the link's rate for "auto"'s choice (fewer: the one assumed)


def speeds(pager, planned) -> Speeds | None:
    """What the device does in a second, for "auto"'s choice of policy
    ([Note: the faster policy, predicted] in training/activations.py): the
    link's rate as measured (`Pager.link_gbps`) or seen in this pager's
    copies, else the one assumed; the matmul rate measured once a process.
    None on the CPU device (the policies' own order stands) or where the
    forward computes nothing torch's flop counter knows in a dtype a matmul
    probe runs in."""
    if not pager.transport.is_cuda or planned.flops_dtype not in PROBED_DTYPES:
        return None
    link = getattr(pager, "_link_gbps", None)
    if link is None:
        pager.engine.meter.resolve(wait=False)  # (the copies' seconds that are known, no sync)
        seen = pager.counters
        link = seen.h2d_gbps if seen.h2d_bytes >= LINK_SEEN_BYTES and seen.h2d_seconds else ASSUMED_LINK_GBPS
    moved = sum(seg.page_bytes for b in pager.blocks for seg in b.weight_segments)
    size = train_bytes(pager)
    pages = sum(size[b] for b in pager.blocks)
    return Speeds(
        link * 1e9,
        measure_matmul_flops(pager.device, planned.flops_dtype),
        2 * moved / max(pages, 1),
    )


def measure(pager, args, kwargs) -> tuple:
    """What the model's forward with these inputs saves per block, on fake
    tensors (training/dry_run.py), and the blocks it names; under a budget
    that covers the process, the room outside pager predicted from the same
    measure is given to `Outside` (its figure for this step on)."""
    blocks = list(pager.blocks)
    # (paged experts' and row tables' parameters hold their host tensors: their calls read device copies)
    placed = {id(p): pager.device for t in pager.expert_tables for p in t.params}
    placed.update((key, pager.device) for key in pager.row_params)
    saved = measure_saved(pager.model, [(b.name, b.module) for b in blocks], args, kwargs, placed)
    if pager.outside is not None:  # (the budget covers the process: blocks leave it room from this step)
        pager.outside.predicted(saved.outside_peak)
    return saved, blocks
