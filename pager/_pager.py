"""The Pager: one per wrapped model. Builds blocks, installs hooks, moves bytes."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from itertools import islice

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from . import _discover
from ._block import Block, Residency, Segment, layout
from ._budget import format_bytes
from ._grads import PagedOutGrad
from ._host import HostArena
from ._schedule import Scheduler
from ._stats import BlockStats, Stats, zero_counters
from ._trace import Tracer
from ._transport import CpuTransport, CudaTransport

log = logging.getLogger("pager")

WEIGHTS = ("weights",)
BACKWARD = ("weights", "grads")
STEP = ("weights", "grads", "state")
PREFETCH_WINDOW = 16  # how many predicted uses prefetch looks through
NEVER_RAN_STEPS = 10  # after this many steps, say which blocks never ran
STALL_WINDOW_STEPS = 10  # judge stalls over windows of this many steps
STALL_SHARE = 0.5  # warn when compute waited for fetches this share of the time

_PAGERS: "weakref.WeakKeyDictionary[nn.Module, Pager]" = weakref.WeakKeyDictionary()


class BudgetError(RuntimeError):
    """The blocks that must be on the device at once do not fit the budget."""


def _record_range(name: str):
    return torch.profiler.record_function(name)


def _locked(method):
    """Run a pager entry point under the pager's lock.

    [Note: threads]
    Hooks run on the thread that calls forward, and backward hooks on the
    autograd engine's threads. One re-entrant lock per pager makes each entry
    point (a block's use or release, a backward hook, a step) atomic, so two
    threads running forward on one model interleave at block granularity
    with correct pin counts; if their blocks together exceed the budget, one
    of them gets a BudgetError, never a corrupted state.
    """

    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked


class Pager:
    """Pages one model's blocks between host pages and a device under a budget.

    Made by `pager.wrap`; reach it with `pager.of(model)`.
    """

    def __init__(self, model, device, budget_bytes, named_blocks, *, pin, prefetch_depth):
        self.model = model
        self.device = device
        self.budget_bytes = budget_bytes
        self.prefetch_depth = prefetch_depth
        self.transport = CudaTransport(device) if device.type == "cuda" else CpuTransport(device)
        self.arena = HostArena(pin=pin and device.type == "cuda")
        self.scheduler = Scheduler()
        self.blocks: list[Block] = []
        self.remainder: Block | None = None
        self.resident: dict[Block, None] = {}  # ordered set of blocks with device bytes
        self.resident_bytes = 0
        self._stats = Stats(budget_bytes=budget_bytes)
        self._hooks: list = []
        self._tick = 0
        self._root_depth = 0
        self._pending_stalls: list = []   # (block, compute arrived, fetch landed)
        self._pending_copies: list = []   # (block, direction, start, end, nbytes)
        self.tracer = Tracer(cuda=device.type == "cuda")
        self._backward_holds: dict[Block, int] = {}
        self._final_callback_queued = False
        self._owner: dict[int, tuple[Block, int]] = {}  # id(param) -> (block, slot index in grads)
        self._param_block: dict[int, Block] = {}
        self._original_device: dict[int, torch.device] = {}
        self._optimizers: list = []
        self._lock = threading.RLock()  # see _locked
        self._warned: set[str] = set()
        self._step_misses = 0
        self._expect_used = False
        self._window = (time.perf_counter(), 0.0)  # (start, stall seconds at start)
        self._closed = False
        self._named_blocks = named_blocks
        # The least budget that runs: the remainder and the largest block with
        # the blocks around it and those it borrows tied tensors from.
        self.min_budget_bytes = 0

    # ------------------------------------------------------------------ build
    def build(self, owned, uses) -> None:
        order = [owned.get(i, []) for i in range(len(self._named_blocks))] + [owned.get(None, [])]
        self.arena.reserve([layout([(n, t) for n, t, _p in named])[1] for named in order if named])
        for i, (name, module) in enumerate(self._named_blocks):
            self.blocks.append(Block(name, module, i))
        for i, block in enumerate(self.blocks):
            self._build_weights(block, owned.get(i, []))
        if owned.get(None):
            self.remainder = Block("<remainder>", None, len(self.blocks))
            self._build_weights(self.remainder, owned[None])
        for i, deps in uses.items():
            user = self.blocks[i] if i is not None else self.remainder
            for j in deps:
                owner = self.blocks[j] if j is not None else self.remainder
                if user is self.remainder:
                    owner.resident_for_life = True
                elif owner is not self.remainder:
                    user.deps.append(owner)
        for block in self.all_blocks():
            if block.resident_for_life or block is self.remainder:
                block.resident_for_life = True
                self._acquire(block, WEIGHTS, record=False)
        self._install_hooks()

    def all_blocks(self):
        return self.blocks + ([self.remainder] if self.remainder is not None else [])

    def _build_weights(self, block: Block, named: list) -> None:
        tensors = [t for _n, t, _p in named]
        slots, nbytes = layout([(n, t) for n, t, _p in named])
        host = self.arena.allocate(nbytes)
        for slot, t in zip(slots, tensors):
            slot.view_of(host).copy_(t.detach())
            self._original_device[id(t)] = t.device
        flat = self.transport.new_flat(nbytes)
        seg = Segment("weights", slots, nbytes, host, flat)
        self.transport.allocate(flat, nbytes)
        for slot, t in zip(slots, tensors):
            t.data = slot.view_of(flat)
        seg.tensors = tensors
        self.transport.free(flat)
        block.segments["weights"] = seg
        block.params = [t for _n, t, is_param in named if is_param]
        block.param_names = [n for n, _t, is_param in named if is_param]
        block.stats = BlockStats(block.name, nbytes)
        for p in block.params:
            self._param_block[id(p)] = block

    def _new_segment(self, block: Block, kind: str, named: list) -> Segment:
        slots, nbytes = layout(named)
        host = self.arena.allocate(nbytes)
        flat = self.transport.new_flat(nbytes)
        seg = Segment(kind, slots, nbytes, host, flat, host_valid=False)
        self.transport.allocate(flat, nbytes)
        seg.tensors = [s.view_of(flat) for s in slots]
        self.transport.free(flat)
        block.segments[kind] = seg
        block.stats.nbytes = block.nbytes()
        return seg

    def _ensure_grads_segment(self, block: Block) -> None:
        if "grads" in block.segments:
            return
        trainable = [(n, p) for n, p in zip(block.param_names, block.params) if p.requires_grad]
        if not trainable:
            return
        seg = self._new_segment(block, "grads", trainable)
        seg.params = [p for _n, p in trainable]
        seg.names = [n for n, _p in trainable]
        for i, p in enumerate(seg.params):
            self._owner[id(p)] = (block, i)

    # ------------------------------------------------------------ residency
    def _acquire(self, block: Block, kinds, record: bool = True) -> None:
        """Make `kinds` of `block` (and its deps) usable by compute; pin them.

        On failure nothing stays pinned."""
        done = []
        try:
            for dep in block.deps:
                self._acquire(dep, kinds, record)
                done.append(dep)
            self._acquire_one(block, kinds, record)
        except BaseException:
            for dep in done:
                self._release(dep)
            raise

    def _acquire_one(self, block: Block, kinds, record: bool) -> None:
        if "grads" in kinds:
            self._ensure_grads_segment(block)
        if record:
            self.scheduler.observe(block, kinds)
            self._unguard(block)  # used through its own hooks: guards not needed while resident
        missing = block.missing_bytes(kinds)
        block.pins += 1
        try:
            if missing:
                with _record_range(f"pager::fetch[{block.name}]"):
                    if not self._make_room(missing, protect={block}):
                        self._raise_no_room(block, missing)
                    self._fetch(block, kinds)
        except BaseException:
            block.pins -= 1
            raise
        if record:
            block.uses += 1
        if missing and block.fetched_data and record:
            block.stats.misses += 1
            self._stats.misses += 1
            self._step_misses += 1
        elif record:
            block.stats.hits += 1
            self._stats.hits += 1
        self._wait_for(block)
        self._expose_grads(block)
        self._apply_pending(block)
        if block.pins == 1:
            block.compute_start = self.tracer.stamp()
        self._tick += 1
        block.last_use_tick = self._tick

    def _wait_for(self, block: Block) -> None:
        if block.fetch_event is None:
            block.residency = Residency.DEVICE
            return
        with _record_range(f"pager::wait[{block.name}]"):
            if self.transport.is_cuda:
                arrive = torch.cuda.Event(enable_timing=True)
                arrive.record()
                self._pending_stalls.append((block, arrive, block.fetch_event))
                self.tracer.span("wait", block.name, arrive, block.fetch_event)
                if len(self._pending_stalls) > 1024:
                    self._resolve_events(wait=False)
            self.transport.compute_waits(block.fetch_event)
        block.fetch_event = None
        block.residency = Residency.DEVICE

    def _apply_pending(self, block: Block) -> None:
        seg = block.segments.get("grads")
        if seg is None or not seg.resident or not seg.pending_scale:
            return
        with torch.no_grad():
            for i, scale in seg.pending_scale.items():
                if seg.params[i].grad is seg.tensors[i]:
                    seg.tensors[i].mul_(scale) if scale != 0.0 else seg.tensors[i].zero_()
        seg.pending_scale.clear()

    def _release(self, block: Block) -> None:
        for dep in block.deps:
            self._release(dep)
        block.pins -= 1
        if block.pins == 0:
            # Memory of this block may be reused once compute is past this point
            # (unless its tensors change after it: see _evict).
            block.last_use_event = self.transport.record_compute()
            block.release_versions = block.versions()
            if self.tracer.enabled:
                end = block.last_use_event if self.transport.is_cuda else time.perf_counter()
                self.tracer.span("compute", block.name, block.compute_start, end)

    def _fetch(self, block: Block, kinds) -> None:
        allocated, moved, nbytes, first, end = False, False, 0, None, None
        for kind in kinds:
            seg = block.segments.get(kind)
            if seg is None or seg.resident:
                continue
            self._allocate(block, seg)
            allocated = True
            self.resident_bytes += seg.nbytes
            if kind == "grads":
                self._check_grads_present(seg)
            if seg.host_valid:
                start, end = self.transport.h2d(seg.flat, seg.host, after=(seg.writeback_event,))
                first = first if moved else start
                moved = True
                nbytes += seg.nbytes
                self._copied(block, "h2d", start, end, seg.nbytes)
            seg.resident = True
            seg.snapshot_versions()
        block.fetched_data = moved
        if moved:
            block.stats.fetches += 1
        if allocated:
            # One mark after every allocation and copy: compute waits on it.
            event = self.transport.mark_h2d()
            end = event if event is not None else time.perf_counter()
            if event is not None:
                block.fetch_event = event
                block.residency = Residency.FETCHING
            elif block.residency is Residency.HOST:
                block.residency = Residency.DEVICE
        if moved:
            self.tracer.span("fetch", block.name, first, end, nbytes)
        self.resident[block] = None
        self._stats.peak_resident_bytes = max(self._stats.peak_resident_bytes, self.resident_bytes)

    def _allocate(self, block: Block, seg: Segment) -> None:
        """Device memory for `seg`; on out-of-memory, evict what can go and retry once."""
        try:
            self.transport.allocate(seg.flat, seg.nbytes)
            return
        except torch.cuda.OutOfMemoryError:
            pass
        for other in list(self.resident):
            if other is not block and other.pins == 0 and not other.resident_for_life:
                self._evict(other)
        if self.transport.is_cuda:
            torch.cuda.synchronize(self.device)  # error path: let freed memory settle
            torch.cuda.empty_cache()
        try:
            self.transport.allocate(seg.flat, seg.nbytes)
            log.warning("pager: out of device memory fetching %r; evicted idle blocks and retried", block.name)
        except torch.cuda.OutOfMemoryError:
            from ._budget import device_memory

            free, total = device_memory(self.device)
            raise BudgetError(
                f"pager: out of device memory fetching {block.name!r} ({seg.kind}, {format_bytes(seg.nbytes)}), "
                f"even after evicting every idle block: budget {format_bytes(self.budget_bytes)}, pager holds "
                f"{format_bytes(self.resident_bytes)}, the device has {format_bytes(free)} free of "
                f"{format_bytes(total)}. Other allocations (activations, other models) take the rest: lower "
                f"the budget (pager.of(model).set_budget(...)), use a smaller batch, or free device memory."
            ) from None

    def _copied(self, block: Block, direction: str, start, end, nbytes: int) -> None:
        """Count a copy's bytes now and its duration when its events resolve."""
        setattr(block.stats, f"{direction}_bytes", getattr(block.stats, f"{direction}_bytes") + nbytes)
        setattr(self._stats, f"{direction}_bytes", getattr(self._stats, f"{direction}_bytes") + nbytes)
        if self.transport.is_cuda:
            self._pending_copies.append((block, direction, start, end))
            if len(self._pending_copies) > 1024:
                self._resolve_events(wait=False)
        else:
            self._add_seconds(block, f"{direction}_seconds", end - start)
            if direction == "h2d":  # the CPU device copies synchronously: compute waited
                self._add_seconds(block, "stall_seconds", end - start)

    def _add_seconds(self, block: Block, field: str, seconds: float) -> None:
        setattr(block.stats, field, getattr(block.stats, field) + seconds)
        setattr(self._stats, field, getattr(self._stats, field) + seconds)

    def _check_grads_present(self, seg: Segment) -> None:
        """Before fetching a grads page: is any gradient in it still wanted?

        [Note: gradients are exposed only after compute waits]
        A fetch (often a prefetch) only copies the page in; `param.grad` stays
        a PagedOutGrad until the block is acquired and compute has waited on the
        copy (`_expose_grads`). Otherwise user code between a prefetch and the
        use (zero_grad(set_to_none=False), a read) would race the copy."""
        present = False
        for i, p in enumerate(seg.params):
            if isinstance(p.grad, PagedOutGrad) and p.grad.segment is seg:
                present = True
            else:
                seg.pending_scale.pop(i, None)
        seg.host_valid = present

    def _expose_grads(self, block: Block) -> None:
        seg = block.segments.get("grads")
        if seg is None or not seg.resident:
            return
        for i, p in enumerate(seg.params):
            if isinstance(p.grad, PagedOutGrad) and p.grad.segment is seg:
                p.grad = seg.tensors[i]

    def _evict(self, block: Block) -> None:
        assert block.pins == 0 and not block.resident_for_life, block
        with _record_range(f"pager::evict[{block.name}]"):
            grads = block.segments.get("grads")
            if grads is not None and grads.resident:
                self._gather_grads(grads)
            # [Note: the last use, or a fresh event]
            # The write-back and the reuse of the memory are ordered after the
            # block's last use. If its tensors changed after that release (the
            # user's zero_grad(set_to_none=False), clip_grad_norm_, gathered
            # gradients: version counters tell), they are ordered after
            # everything enqueued on the compute stream so far instead. Always
            # taking a fresh event would be safe too, but it serialises each
            # prefetch behind current compute (measured: NAS step 1.20x -> 1.35x).
            if block.last_use_event is None or block.versions() != block.release_versions:
                ready = self.transport.record_compute()
            else:
                ready = block.last_use_event
            for kind, seg in block.segments.items():
                if not seg.resident:
                    continue
                writeback = None
                if seg.is_dirty():
                    start, end = self.transport.d2h(seg.host, seg.flat, after=(ready,))
                    writeback = end if self.transport.is_cuda else None
                    seg.writeback_event = writeback
                    seg.host_valid = True
                    self._copied(block, "d2h", start, end, seg.nbytes)
                    self.tracer.span("writeback", block.name, start, end, seg.nbytes)
                if kind == "grads":
                    self._page_out_grads(seg)
                self.transport.free(seg.flat, after=(ready, writeback))
                seg.resident = False
                self.resident_bytes -= seg.nbytes
        block.residency = Residency.HOST
        block.fetch_event = None
        self.resident.pop(block, None)
        if block.module is not None:
            self._guard(block)
        block.stats.evictions += 1
        self._stats.evictions += 1

    def _gather_grads(self, seg: Segment) -> None:
        """Bring gradients that autograd or the user put elsewhere into the page."""
        for i, p in enumerate(seg.params):
            g = p.grad
            if g is not None and g is not seg.tensors[i] and not isinstance(g, PagedOutGrad):
                with torch.no_grad():
                    seg.tensors[i].copy_(g)
                p.grad = seg.tensors[i]

    def _page_out_grads(self, seg: Segment) -> None:
        present = False
        for i, p in enumerate(seg.params):
            if p.grad is seg.tensors[i]:
                p.grad = PagedOutGrad(p, seg.names[i], seg, i)
                present = True
            elif isinstance(p.grad, PagedOutGrad) and p.grad.segment is seg:
                present = True  # fetched but never exposed: the page still holds it
        seg.host_valid = present

    def _make_room(self, nbytes: int, protect, within: int | None = None) -> bool:
        """Evict until `nbytes` more fit. With `within`, only evict blocks whose
        next use is further than `within` uses away, and never kept ones."""
        if self.resident_bytes + nbytes <= self.budget_bytes:
            return True
        inf = float("inf")
        distance = self.scheduler.next_use()
        kept = self.scheduler.kept
        candidates = [
            b for b in self.resident if b.pins == 0 and not b.resident_for_life and b not in protect
        ]
        candidates.sort(key=lambda b: (b in kept, -distance.get(b, inf), b.last_use_tick))
        for b in candidates:
            if within is not None and (b in kept or distance.get(b, inf) <= within):
                return False
            self._evict(b)
            if self.resident_bytes + nbytes <= self.budget_bytes:
                return True
        return False

    def _raise_no_room(self, block: Block, missing: int):
        pinned = [b for b in self.resident if b.pins > 0 or b.resident_for_life]
        held = ", ".join(f"{b.name} ({format_bytes(b.device_bytes())})" for b in pinned[:6])
        raise BudgetError(
            f"pager: block {block.name!r} needs {format_bytes(missing)} more on {self.device}, but "
            f"{format_bytes(self.resident_bytes)} of the {format_bytes(self.budget_bytes)} budget is held "
            f"by blocks in use: {held}. Raise the budget, or use smaller blocks (blocks=...)."
        )

    def _prefetch(self) -> None:
        if not self.prefetch_depth:
            return
        fetched = 0
        for distance, (block, kinds) in enumerate(islice(self.scheduler.upcoming(), PREFETCH_WINDOW)):
            if fetched >= self.prefetch_depth:
                return
            if kinds is WEIGHTS and block.weights.resident and not block.deps:
                continue  # the common case once the working set is resident
            if "grads" in kinds:
                self._ensure_grads_segment(block)
            missing = block.missing_bytes(kinds) + sum(d.missing_bytes(WEIGHTS) for d in block.deps)
            if not missing:
                continue
            if not self._make_room(missing, protect={block, *block.deps}, within=distance):
                return
            for dep in block.deps:
                if dep.missing_bytes(WEIGHTS):
                    self._fetch(dep, WEIGHTS)
            with _record_range(f"pager::prefetch[{block.name}]"):
                self._fetch(block, kinds)
            block.stats.prefetches += 1
            self._stats.prefetches += 1
            fetched += 1

    # ----------------------------------------------------------------- hooks
    def _install_hooks(self) -> None:
        root = self.model
        self._hooks.append(root.register_forward_pre_hook(self._root_pre_forward))
        self._hooks.append(root.register_forward_hook(self._root_post_forward, always_call=True))
        for block in self.blocks:
            pre = self._make_pre_forward(block)
            post = self._make_post_forward(block)
            self._hooks.append(block.module.register_forward_pre_hook(pre, with_kwargs=True))
            self._hooks.append(block.module.register_forward_hook(post, always_call=True))
        self._install_inner_hooks()
        self._known = {id(t) for b in self.all_blocks() for t in b.weights.tensors}
        self._snapshot_structure()
        for block in self.all_blocks():
            for p in block.params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._install_state_dict_hooks()

    def _install_inner_hooks(self) -> None:
        """Guards for a module inside a block called on its own (not through
        the block): it fetches the block for the call instead of reading freed
        memory.

        [Note: guards only while paged out]
        A hook makes every call of its module take PyTorch's slow path (~10 us),
        and a direct call on a resident block is safe anyway. So a block's
        guards are installed when it is evicted and removed when it is next
        used through its own hooks: a model that stays resident pays nothing."""
        block_of = {id(b.module): b for b in self.blocks}
        for block in self.blocks:
            stack = [block.module]
            while stack:
                for child in stack.pop().children():
                    if id(child) in block_of:
                        continue  # a nested block has its own hooks
                    stack.append(child)
                    if child._parameters or child._buffers:
                        held: list = []
                        block.guards.append(
                            (child, self._make_inner_pre(block, held), self._make_inner_post(block, held))
                        )
            self._guard(block)

    def _make_inner_pre(self, block: Block, held: list):
        def inner_pre(module, args):
            if block.pins > 0:  # called from within its block
                held.append(False)
                return
            with self._lock:
                self._acquire(block, WEIGHTS, record=False)
            held.append(True)

        return inner_pre

    def _make_inner_post(self, block: Block, held: list):
        def inner_post(module, args, output):
            if held and held.pop():
                with self._lock:
                    self._release(block)
                    if torch.is_grad_enabled():
                        self._register_pre_backward(block, output)

        return inner_post

    def _guard(self, block: Block) -> None:
        if block.guard_handles is None:
            block.guard_handles = [
                h
                for module, pre, post in block.guards
                for h in (module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True))
            ]

    def _unguard(self, block: Block) -> None:
        if block.guard_handles is not None:
            for h in block.guard_handles:
                h.remove()
            block.guard_handles = None

    def _snapshot_structure(self) -> None:
        self._structure = [
            (m, len(m._parameters), len(m._buffers), len(m._modules)) for m in self.model.modules()
        ]
        self._entries = [
            (table, name, t)
            for m in self.model.modules()
            for table in (m._parameters, m._buffers)
            for name, t in table.items()
            if t is not None
        ]

    def _check_structure(self) -> None:
        """Refuse to run on parameters or buffers pager does not manage
        (identity and count checks over a table made at wrap: no module walk)."""
        changed = any(table.get(name) is not t for table, name, t in self._entries) or any(
            (len(m._parameters), len(m._buffers), len(m._modules)) != (p, b, c) for m, p, b, c in self._structure
        )
        if not changed:
            return
        for name, t in list(self.model.named_parameters(remove_duplicate=False)) + list(
            self.model.named_buffers(remove_duplicate=False)
        ):
            if id(t) not in self._known:
                raise RuntimeError(
                    f"pager: {name!r} was added or replaced after wrap, so pager does not page it (and the old "
                    f"tensor is what it holds). Change models before wrapping: pager.unwrap(model), make the "
                    f"change, then pager.wrap(model, ...) again."
                )
        raise RuntimeError(
            "pager: a module was added to or removed from the model after wrap; pager.unwrap(model), make "
            "the change, then pager.wrap(model, ...) again."
        )

    # ------------------------------------------------------------ state dict
    def _install_state_dict_hooks(self) -> None:
        """`state_dict()` returns host copies; `load_state_dict()` fetches each block.

        [Note: state dicts of a paged model]
        Module.state_dict() returns references to the tensors, and a paged-out
        block's tensors have no memory behind them; a post-hook on the root
        replaces every paged entry with a host copy of its current value (so a
        checkpoint needs no room on the device and loads without a GPU).
        load_state_dict() copies into the tensors in place: a pre-hook on each
        block module fetches the block, a post-hook releases it, and the copies
        bump the version counters, so the block is written back when it leaves.
        """
        names = {}
        for name, t in list(self.model.named_parameters(remove_duplicate=False)) + list(
            self.model.named_buffers(remove_duplicate=False)
        ):
            names[name] = t
        index = {}
        for block in self.all_blocks():
            for i, t in enumerate(block.weights.tensors):
                index[id(t)] = (block, i)
        self._state_names = {n: index[id(t)] for n, t in names.items() if id(t) in index}
        post = getattr(self.model, "register_state_dict_post_hook", None) or self.model._register_state_dict_hook
        self._hooks.append(post(lambda *a: self._state_dict_post(*a)))
        for block in self.blocks:
            self._hooks.append(_load_pre_hook(block.module, self._make_load_pre(block)))
            self._hooks.append(block.module.register_load_state_dict_post_hook(self._make_load_post(block)))

    @_locked
    def _state_dict_post(self, module, state_dict, prefix, local_metadata):
        if self.transport.is_cuda:
            torch.cuda.synchronize(self.device)  # write-backs in flight must land first
        for name, (block, i) in self._state_names.items():
            key = prefix + name
            if key not in state_dict:
                continue
            seg = block.weights
            value = seg.tensors[i] if seg.resident else seg.slots[i].view_of(seg.host)
            state_dict[key] = value.detach().to("cpu", copy=True)

    def _make_load_pre(self, block: Block):
        def load_pre(module, state_dict, prefix, *args):
            with self._lock:
                self._acquire(block, WEIGHTS, record=False)

        return load_pre

    def _make_load_post(self, block: Block):
        def load_post(module, incompatible_keys):
            with self._lock:
                self._release(block)

        return load_post

    @_locked
    def _root_pre_forward(self, module, args):
        self._check_open()
        if self._root_depth == 0:
            self._check_structure()
            self._release_stale_backward_holds()
            self._start_step()
        self._root_depth += 1

    @_locked
    def _root_post_forward(self, module, args, output):
        self._root_depth = max(0, self._root_depth - 1)

    def _release_stale_backward_holds(self) -> None:
        # A backward that raised never ran its final callback: its blocks are
        # still held. No backward runs across a new root forward, so let go.
        if self._backward_holds:
            log.debug("pager: releasing blocks held by a backward that did not finish")
            self._end_of_backward()

    def _start_step(self) -> None:
        self.tracer.new_step()
        changed = self.scheduler.start_step()
        if changed:
            self._stats.order_changes += 1
            if self._step_misses and not self._expect_used:
                self._warn_once(
                    "order", "pager: the order of blocks changed between steps (%d fetches on demand in the last "
                    "step); if it changes every step (a NAS supernet's sampled path), say what comes next with "
                    "pager.of(model).expect(modules) so it is prefetched.", self._step_misses)
        self._step_misses, self._expect_used = 0, False
        self._advise()
        fixed = self.remainder.device_bytes() if self.remainder is not None else 0
        for b in self.blocks:
            if b.resident_for_life:
                fixed += b.nbytes()
        self.scheduler.choose_kept(self.budget_bytes, lambda b: b.nbytes(), fixed)
        self._stats.steps += 1

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _advise(self) -> None:
        """Warnings that need a few steps of history (each at most once)."""
        steps = self._stats.steps
        if steps == NEVER_RAN_STEPS + 1:
            idle = [b for b in self.blocks if b.uses == 0]
            if idle:
                self._warn_once(
                    "never_ran", "pager: %d block(s) never ran in %d steps (%s%s), holding %s of host pages; if "
                    "they are unused, leave them out of the model (NAS candidates not yet sampled are expected).",
                    len(idle), NEVER_RAN_STEPS, ", ".join(b.name for b in idle[:4]), ", ..." if len(idle) > 4 else "",
                    format_bytes(sum(b.nbytes() for b in idle)))
        # Stalls are judged over windows of steps, the first one starting after
        # the first step (whose fetches are the unavoidable cold start).
        if steps == 2 or (steps > 2 and (steps - 2) % STALL_WINDOW_STEPS == 0):
            if self.transport.is_cuda:
                self._resolve_events(wait=False)
            start, stall_at_start = self._window
            now, stall = time.perf_counter(), self._stats.stall_seconds
            if steps > 2 and now > start and stall - stall_at_start > STALL_SHARE * (now - start):
                self._warn_once(
                    "stalls", "pager: compute waited for transfers %.0f%% of the last %d steps; a larger budget "
                    "keeps more blocks resident (pager.plan(model, budget) shows what moves), and smaller blocks "
                    "(blocks=...) overlap better.", 100 * (stall - stall_at_start) / (now - start), STALL_WINDOW_STEPS)
            self._window = (now, stall)

    def _make_pre_forward(self, block: Block):
        def pre_forward(module, args, kwargs):
            with self._lock:
                try:
                    self._acquire(block, WEIGHTS)
                except BaseException:
                    block.unpinned_calls += 1  # the post-hook (always called) must not release
                    raise
                self._prefetch()
            if torch.is_grad_enabled() and block.params and any(p.requires_grad for p in block.params):
                return self._register_post_backward(block, args, kwargs)
            return None

        return pre_forward

    def _make_post_forward(self, block: Block):
        def post_forward(module, args, output):
            with self._lock:
                if block.unpinned_calls:
                    block.unpinned_calls -= 1
                    return None
                self._release(block)
            if torch.is_grad_enabled():
                self._register_pre_backward(block, output)
            return None

        return post_forward

    def _register_pre_backward(self, block: Block, output) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        fired = [False]

        def pre_backward(grad):
            if not fired[0]:
                fired[0] = True
                self._pre_backward(block)
            return grad

        for t in tensors:
            t.register_hook(pre_backward)

    @_locked
    def _pre_backward(self, block: Block) -> None:
        if not self._final_callback_queued:
            self._final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._acquire(block, BACKWARD)
        self._backward_holds[block] = self._backward_holds.get(block, 0) + 1
        self._prefetch()

    def _register_post_backward(self, block: Block, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        outs = _PostBackward.apply(self, block, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(flat, spec)

    @_locked
    def _post_backward(self, block: Block) -> None:
        if self._backward_holds.get(block, 0) > 0:
            self._backward_holds[block] -= 1
            self._release(block)

    @_locked
    def _end_of_backward(self) -> None:
        self._final_callback_queued = False
        for block, holds in list(self._backward_holds.items()):
            for _ in range(holds):
                self._release(block)
        self._backward_holds.clear()

    @_locked
    def _on_grad(self, param: torch.Tensor) -> None:
        block, i = self._owner.get(id(param), (None, None))
        if block is None:
            block = self._param_block[id(param)]
            self._ensure_grads_segment(block)
            block, i = self._owner[id(param)]
        seg = block.segments["grads"]
        if not seg.resident:  # a gradient for a block not acquired for backward
            self._acquire(block, ("grads",), record=False)
            self._release(block)
        view = seg.tensors[i]
        if param.grad is not view:
            with torch.no_grad():
                view.copy_(param.grad)
            param.grad = view

    # ---------------------------------------------------------------- public
    @_locked
    def stats(self) -> Stats:
        """Counters since the last `reset()` (see `Stats`), with per-block rows."""
        self._resolve_events()
        s = self._stats
        s.resident_bytes = self.resident_bytes
        for b in self.all_blocks():
            b.stats.resident_bytes = b.device_bytes()
        s.blocks = [b.stats for b in self.all_blocks()]
        return s

    def report(self) -> str:
        """`stats()` as a table, with the link's measured peak, device memory
        and utilisation (pynvml) and host RAM and pinned bytes (psutil).

        Example:
            >>> print(pager.of(model).report())
        """
        from ._report import system_lines

        s = self.stats()
        peak = self.link_gbps()
        lines = [s.report(), ""]
        if s.h2d_seconds:
            lines.append(
                f"host->device: {s.h2d_gbps:.1f} GB/s while copying, {100 * s.h2d_gbps / peak:.0f}% of the "
                f"{peak:.1f} GB/s measured peak; device->host: {s.d2h_gbps:.1f} GB/s"
            )
        lines += system_lines(self)
        return "\n".join(lines)

    def link_gbps(self) -> float:
        """The host-to-device copy rate this machine reaches from page-locked
        memory (measured once, 256 MiB), the ceiling for fetches."""
        if getattr(self, "_link_gbps", None) is None:
            from ._report import measure_link_gbps

            self._link_gbps = measure_link_gbps(self.device, pinned=self.arena.pin)
        return self._link_gbps

    @_locked
    def reset(self) -> None:
        """Zero every counter (peak resident bytes restart from what is resident now)."""
        self._resolve_events()
        zero_counters(self._stats)
        for b in self.all_blocks():
            zero_counters(b.stats)
        self._stats.peak_resident_bytes = self.resident_bytes

    def _resolve_events(self, wait: bool = True) -> None:
        """Turn timing-event pairs into seconds: stalls (compute arrived, fetch
        landed) and copy durations. With wait=False only pairs already complete
        are taken (no host sync)."""
        stalls, copies = [], []
        for block, arrive, done in self._pending_stalls:
            if not wait and not (arrive.query() and done.query()):
                stalls.append((block, arrive, done))
                continue
            arrive.synchronize()  # both ends must have completed
            done.synchronize()
            ms = arrive.elapsed_time(done)
            if ms > 0:
                self._add_seconds(block, "stall_seconds", ms / 1e3)
        for block, direction, start, end in self._pending_copies:
            if not wait and not end.query():
                copies.append((block, direction, start, end))
                continue
            end.synchronize()
            self._add_seconds(block, f"{direction}_seconds", start.elapsed_time(end) / 1e3)
        self._pending_stalls, self._pending_copies = stalls, copies

    @_locked
    def start_trace(self, steps: int = 4) -> None:
        """Record fetches, write-backs, waits and computes of the last `steps`
        steps for `trace()` (two CUDA events per block use while on).

        Example:
            >>> pager.of(model).start_trace(steps=2)
        """
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"pager: start_trace(steps={steps!r}) needs a whole number of steps >= 1.")
        self.tracer.start(steps)

    def trace(self, path: str) -> str:
        """Write a Chrome/Perfetto trace of the recorded steps, one track per stream.

        Args:
            path: the JSON file to write (open it in ui.perfetto.dev or chrome://tracing).

        Returns:
            `path`.

        Example:
            >>> pager.of(model).start_trace(steps=2)
            >>> model(x); model(x)
            >>> pager.of(model).trace("pager_trace.json")
        """
        if not self.tracer.enabled:
            raise RuntimeError(
                "pager: tracing is off; call pager.of(model).start_trace(steps=N) (or wrap(..., trace_steps=N)) "
                "before the steps to record, then trace(path)."
            )
        self.tracer.write(path)
        return path

    @_locked
    def expect(self, modules) -> None:
        """Say which blocks the next forward will use, in order, so they are prefetched.

        Args:
            modules: block modules (or modules inside blocks) in the order the
                next forward runs them; e.g. the candidate ops of the path a
                NAS supernet sampled for this step.

        Example:
            >>> path = [layer.candidates[k] for layer, k in zip(net.layers, choice)]
            >>> pager.of(net).expect(path)
        """
        by_module = {id(b.module): b for b in self.blocks}
        uses = []
        for m in modules:
            block = by_module.get(id(m))
            if block is None:
                raise ValueError(
                    f"pager: expect() got a {type(m).__name__} that is not a block of this model; "
                    f"pass block modules (pager.of(model).block_names() lists them)."
                )
            uses.append((block, WEIGHTS))
        self.scheduler.expect(uses)
        self._expect_used = True
        self._prefetch()

    def attach(self, optimizer) -> None:
        """Page `optimizer`'s state with its blocks and stream its `step()` per block.

        Idempotent. The optimizer may be built before or after `wrap` from
        `model.parameters()`; it is never rebuilt, and any `torch.optim`
        optimizer with per-parameter state works.

        Args:
            optimizer: a `torch.optim.Optimizer` over this model's parameters.

        Example:
            >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
            >>> pager.of(model).attach(opt)
        """
        from ._optim import attach

        attach(self, optimizer)

    @_locked
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the model's gradients, wherever they are.

        Use it instead of torch's when a step's blocks do not fit the budget
        (gradients of blocks that left are in host pages: torch's raises an
        error on them). Resident gradients are scaled in place; paged-out ones
        when they return.

        Args:
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm (inf for the max-norm).

        Returns:
            The total norm before clipping, as a 0-dim tensor.

        Example:
            >>> loss.backward()
            >>> pager.of(model).clip_grad_norm_(1.0)
            >>> opt.step(); opt.zero_grad()
        """
        # Mirrors torch.nn.utils.clip_grad_norm_ (norms of each gradient, in
        # model.parameters() order, then the norm of those), so that on the CPU
        # device the result is bitwise the same.
        values, targets = [], []
        with torch.no_grad():
            for p in self.model.parameters():
                g = p.grad
                if g is None:
                    continue
                if isinstance(g, PagedOutGrad):
                    seg, i = g.segment, g.index
                    if seg.writeback_event is not None and self.transport.is_cuda:
                        seg.writeback_event.synchronize()  # the page must hold the bytes
                    value = seg.slots[i].view_of(seg.host)
                    if i in seg.pending_scale:
                        value = value * seg.pending_scale[i]
                    values.append(value)
                else:
                    values.append(g)
                targets.append(p)
            if not values:
                return torch.tensor(0.0, device=self.device)
            norms = [n.to(self.device) for n in _norms_by_device(values, norm_type)]
            total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for p in targets:
                g = p.grad
                if isinstance(g, PagedOutGrad):
                    g.segment.pending_scale[g.index] = g.segment.pending_scale.get(g.index, 1.0) * float(coef)
                else:
                    g.mul_(coef.to(g.dtype))
        return total

    @_locked
    def set_budget(self, budget) -> None:
        """Change the budget of a live pager; blocks leave until the new one holds.

        Args:
            budget: as for `pager.wrap` (bytes, "10GiB", "60%", "auto").

        Example:
            >>> pager.of(model).set_budget("4GiB")
        """
        from ._budget import parse_budget

        nbytes = parse_budget(budget, self.device)
        if nbytes < self.min_budget_bytes:
            raise ValueError(
                f"pager: budget={budget!r} ({format_bytes(nbytes)}) is below the {format_bytes(self.min_budget_bytes)} "
                f"this model needs (the remainder and its largest block); give at least that."
            )
        for block in list(self.resident):
            if self.resident_bytes <= nbytes:
                break
            if block.pins == 0 and not block.resident_for_life:
                self._evict(block)
        if self.resident_bytes > nbytes:
            raise ValueError(
                f"pager: cannot lower the budget to {format_bytes(nbytes)} now: blocks in use hold "
                f"{format_bytes(self.resident_bytes)}; call set_budget between steps."
            )
        self.budget_bytes = nbytes
        self._stats.budget_bytes = nbytes

    def block_names(self) -> list[str]:
        """The qualified names of the blocks, in model order."""
        return [b.name for b in self.blocks]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("pager: this model was unwrapped; wrap it again to page it.")


class _PostBackward(torch.autograd.Function):
    """Identity on a block's inputs whose backward runs once the block's is done."""

    @staticmethod
    def forward(ctx, pager, block, *tensors):
        ctx.pager, ctx.block = pager, block
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.pager._post_backward(ctx.block)
        return (None, None, *grads)


def _norms_by_device(values, norm_type):
    """Per-tensor norms, computed with foreach kernels per (device, dtype) run."""
    out = [None] * len(values)
    groups: dict = {}
    for i, v in enumerate(values):
        groups.setdefault((v.device, v.dtype), []).append(i)
    for idx in groups.values():
        for i, n in zip(idx, torch._foreach_norm([values[i] for i in idx], norm_type)):
            out[i] = n
    return out


def _load_pre_hook(module: nn.Module, hook):
    public = getattr(module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        return public(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


def _restore(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().to(device, copy=True)


def close(pager: Pager) -> None:
    """Put every tensor back on its original device with its current value."""
    if pager.transport.is_cuda:
        torch.cuda.synchronize(pager.device)  # unwrap is not a hot path: settle all copies
    for h in pager._hooks:
        h.remove()
    pager._hooks.clear()
    for block in pager.blocks:
        pager._unguard(block)
    for opt_link in pager._optimizers:
        opt_link.detach()
    for block in pager.all_blocks():
        w = block.weights
        source = w.tensors if w.resident else w.host_views()
        values = [_restore(v, pager._original_device[id(t)]) for v, t in zip(source, w.tensors)]
        grads = block.segments.get("grads")
        grad_values = []
        if grads is not None:
            host = grads.host_views()
            for i, p in enumerate(grads.params):
                g = p.grad
                if isinstance(g, PagedOutGrad):
                    value = host[i].clone()
                    if g.segment.pending_scale.get(i) is not None:
                        value.mul_(g.segment.pending_scale[i])
                    grad_values.append((p, value))
                elif g is not None:
                    grad_values.append((p, g))
        for t, v in zip(w.tensors, values):
            t.data = v
        for p, g in grad_values:
            p.grad = _restore(g, p.device)
    pager.arena.close()
    pager.resident.clear()
    pager.resident_bytes = 0
    pager._closed = True
