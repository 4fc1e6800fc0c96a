"""What a block's forward saves for its backward: counted, kept, sent to host memory, or dropped and recomputed.

A block's forward that builds a graph may run under pager's saved-tensor
hooks (`base/saving.py`): each tensor autograd saves goes to the policy of
this module that the use passed in, which decides what the graph holds
instead.

[Note: activations off the device]
With `activations="offload"`, each activation a training forward saves (a
dense tensor on the device of at least `OFFLOAD_MIN_BYTES`: contiguous, or a
permutation of its storage's bytes, as attention's transposed q, k and v,
which go and come back with their strides, each copy one run of bytes; not a
block's own weights, which page with the block) is copied to pinned host
memory on the d2h stream as soon as compute has written it. The graph holds
a `Sent` instead; it belongs to the block whose forward ran last (ops between
blocks too: a `tanh` after a block is undone right before that block's
backward). Its device memory is let go once the copy has read it: when its
event is seen complete, or, once more than a block's worth is being copied
out, at once after making compute wait for the copy (compute is the only
stream that allocates from that memory's pool, so reuse is then ordered after
the copy; `record_stream` would hold it until a later allocation happens to
notice, and the allocator reserves more meanwhile). When the backward reaches
a block (its pre-backward hook), the activations of that block and of the
block before it (the next one backward) are copied back on the h2d stream, so
the copy of one overlaps the backward of the other; an activation that was
not brought ahead is brought when autograd asks for it. One whose device
memory is still held for its copy out (the forward's last sends, when the
backward begins before the link has carried them) is not copied back: the
backward uses the device tensor itself, unchanged since it was saved (its
version), compute first waiting for the copy out to have read it, as for
any memory it frees ("reused": no copy in, and one block's activations held
once, not twice, where the forward meets the backward). A copy on the host is
the value as it was saved, so an in-place change after the forward cannot
corrupt the gradient (autograd would refuse it; here it is simply not seen).
A tensor that a block's forward saves several times (a norm's output saved
by the q, k and v projections) is copied out once and brought back once; its
device copy stays while later saves' unpacks are still to ask for it.

[Note: activations recomputed]
With `activations="recompute"` (pager's own checkpointing: the model's code
does not change), a block's training forward keeps only its inputs (detached,
with their version), the RNG states and the autocast state (`Recompute`);
each activation it saves is dropped and the graph holds a `Dropped` instead
(index and metadata). The first `Dropped` of a block that its backward asks for
runs the block's forward again (the block is resident: its pre-backward hook
acquired it), in autograd's thread, with the forward's RNG states (dropout
draws the same masks) and autocast, under hooks that keep the i-th saved tensor
for the i-th `Dropped` still alive; pager's own forward hooks then only
acquire and release (`recomputing()`). The forward stops (an exception
from the hook, as torch's checkpoint stops early) once it has saved its last
tensor: what follows, often the block's last matmul, saved nothing. Not under
torch's CUDA sanitizer: its trace hooks run inside the op that raises, with
the exception already set, and fail (a SystemError out of the backward); the
forward then runs to its end, to the same values. Each value is handed out once (a
second backward through a retained graph runs the forward again). A saved
tensor of another shape or dtype than in the forward, or an input changed in
place since, is an error (the recomputation would differ). The block's own
weights are saved as they are: they page with the block.

[Note: buffers a forward changes]
BatchNorm's training forward updates its running statistics in place
(running_mean, running_var, num_batches_tracked), so running it again would
count the batch twice, and the model would no longer be the unwrapped one
(torch's own checkpoint has that flaw). `Recompute` notes the version of
each buffer of the block at the forward's start; at the recomputation, the
buffers whose version moved since (the forward changed them:
num_batches_tracked), and the running statistics of the norm layers in it
(their kernel updates them without moving the version), are copied aside
and put back after it. The recomputation's outputs do not depend on them (a
training BatchNorm normalizes by the batch's statistics).

[Note: caches a forward writes]
A transformers model called with `use_cache` (its default, in training too)
gives each decoder layer a KV cache object that the layer appends its keys
and values to. Running the layer again would append them twice: its
attention would read keys of twice the length (a saved tensor of another
shape: an error under eager attention), and the cache would no longer be
the unwrapped model's. So `Recompute` notes, for each input that is such a
cache (`_cache_layers`: a `layers` list, `update` and `get_seq_length`), the
attributes of each of its layers at the forward's start (a shallow copy:
the layers reassign their tensors, they do not write into them); the
recomputation puts those back on the layers the forward changed, runs, and
then gives those layers what the forward had left them. A layer that writes
into its tensors (a static cache: `StaticCache`) is not put back so; such a
cache in a training forward is not supported (the first pass's measure on
fake tensors fails on it already).

[Note: one budget]
With `activations` other than "keep", the budget bounds blocks and
activations together: what pager's hooks hold on the device for a backward
(activations kept, being copied out, brought back, recomputed, and the inputs
a recomputation keeps) is counted in a `Ledger`, by storage (two views of one
storage count once), as it is saved and until it is freed (a brought or
recomputed activation: until it is handed to autograd). Blocks get the budget
less the most the activations will hold by the plan made before the first
pass ([Note: activations, the automatic choice]), or held in the last
training pass if that was more (`reserve`), so from the first training
step on, blocks and activations stay within the budget together. A pass
may recompute more than the last (a supernet's wider candidate; a forward
that could not be measured): from a block's backward until its recomputation has run,
the reserve is at least what activations hold now and what the block's
forward dropped (counted as it dropped it), and blocks leave as for a fetch
until they fit the room left (`Ledger.recompute_comes`); a prefetch then
does not take that room back. And while activations hold more than in the
whole last pass (`Ledger.grew`), each block's use, forward or backward, has
the blocks fetched before leave until they fit the room left. So under
recompute a pass holds the budget but for what is saved between two uses
(the head's input after the last block, on the order of one activation). What stays
outside: a block's temporaries while it runs, the loss and the gradients
flowing between blocks in the backward, and the allocator's rounding: the
slack (`stats()` gives the allocator's own peak beside pager's).
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections import deque
from contextlib import ExitStack, contextmanager

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..base.budget import format_bytes
from ..base.common import BudgetError, outside_compile
from ..base.registry import entry_of, unguarded
from ..base.saving import tls
from .dry_run import (
    BRING_AHEAD_BLOCKS,  # at a block's backward, the activations of this many blocks before it come back too
    IN_FLIGHT_MIN_BYTES,  # device bytes being copied out before compute waits for the oldest
    KEEP,
    OFFLOAD,
    OFFLOAD_VIEWS_KEPT,  # offload, but saved views that are not contiguous stay (stats say "offload")
    RECOMPUTE,
    SavedBytes,
    _dense,
    choose,
)
from .ledger import Ledger

OFFLOAD_MIN_BYTES = 1 << 20  # smaller activations stay: a copy costs more than it frees
KEEP_LAST_BLOCKS = 1  # the last blocks of a forward keep their activations on the device
AUTO = "auto"
POLICIES = (KEEP, OFFLOAD, RECOMPUTE, AUTO)

log = logging.getLogger("pager")


class Activations:
    """What each block's training forward does with what it saves (the
    `activations=` of `wrap`): keep it, send it to host memory, or drop it
    and recompute it. Gives `begin_saving` its arguments.

    [Note: activations, the automatic choice]
    "auto" (the default) decides before a training pass runs, from what the
    forward will save, measured on fake tensors at the first training
    forward ([Note: activations measured without running] in
    training/dry_run.py), and again when an input grows (a larger batch, a
    longer sequence). Nothing is tried on a pass that could break the budget.
    First, what the budget has room for stays: the room is the budget less
    every block with all its pages (weights, gradients, optimizer state:
    those still to come are counted, the attached optimizer's state; none
    before one is attached, and the choice is made again when it appears)
    and less what the activations that do not stay hold (`Room.spare_bytes`);
    walking back from the forward's last block, each block whose forward
    saves (on the device, each storage once) what still fits keeps it, the
    longest such tail with the rest's policy all within that room. So
    activations never take room that blocks use, the last blocks, which the
    backward needs first and whose copies would have no time to overlap,
    stay first, and where everything fits, nothing moves: as "keep", within
    the budget.
    The other blocks' activations are offloaded or recomputed, one policy
    for them all, the first of these that the budget holds beside the least
    room blocks run in ([Note: what each policy holds, predicted] in
    training/dry_run.py): offload with saved views that are not contiguous
    (attention's transposed q, k and v) staying on the device, which moves
    the fewest bytes; offload of every dense save; recompute, which holds
    least and costs a forward again. (Measured on the 1B decoder at 25-100%
    of weights, gradients and AdamW state, offloading was the fastest of the
    three wherever it held; the trials that timed the policies on passes
    of their own cost 1.2x on those passes and could break the budget.) A
    budget that none holds is refused at that first forward, before it runs,
    with the least budget that holds: a `BudgetError`. The reserve, what
    blocks leave to activations, is the prediction from the first pass on,
    or the most the last pass held where that was more. Values are the same under every
    policy (bit for bit on the CPU device).
    A forward that cannot run on fake tensors (it reads values) runs its
    first pass under recompute (it holds least), the reserve growing as it
    goes, and "auto" keeps recompute for the blocks that do not keep theirs.
    Under `torch.compile` of the whole model, where neither offload nor
    recompute can run ([Note: pager under torch.compile] in model/hooks.py),
    "auto" keeps every block's activations, counted, and says so once.

    Args:
        policy: "offload", "recompute" or "auto" (see the Notes; "keep" needs no `Activations`).
        transport: the pager's transport.
        stats: the pager's `Stats`.
        budget_bytes: the budget now, less what the process holds outside pager (None: unbounded).
        spare_bytes: what the budget holds beyond every block with all its
            pages, those still to come included, and beyond what else is
            reserved (`Room.spare_bytes`).
        least_bytes: the least that blocks (with their gradients and optimizer
            state) and what pager keeps beside them need in a training step.
        measure: `(args, kwargs) -> (SavedBytes, blocks)`: the root forward's
            saves per block, on fake tensors, and the `Block` of each name;
            raises `ValueError` where the forward cannot run on them.
        outside_bytes: what the process holds outside pager, learned
            (`budget_covers="process"`), for the refusal's figures.
        budget_total: the budget as given (the refusal names budgets so).
    """

    def __init__(
        self,
        policy: str,
        transport,
        stats,
        budget_bytes=lambda: None,
        spare_bytes=lambda: 0,
        least_bytes=lambda: 0,
        measure=None,
        outside_bytes=lambda: 0,
        budget_total=lambda: 0,
    ):
        self.stats, self.transport, self.budget_bytes, self.spare_bytes = stats, transport, budget_bytes, spare_bytes
        self.least_bytes, self.measure, self.outside_bytes = least_bytes, measure, outside_bytes
        self.budget_total = budget_total
        self.ledger = Ledger(transport.device)
        self.offload = ActivationOffload(transport, stats, self.ledger)  # also keeps the forward's order of blocks
        self.policy = OFFLOAD if policy == AUTO else policy  # of the blocks that do not keep
        self.asked = policy  # (what the user said, for errors)
        self.kept: set = set()  # "auto": blocks whose activations stay this pass
        self.kept_bytes = 0  # ... what their last forwards saved
        self._kept_all = False  # ... and that is every block of the last forward
        self.saved_bytes: dict = {}  # block -> what its forwards saved in the last training pass
        self._saving: dict = {}  # ... in the pass under way
        self._compiled_whole = False  # a block ran under torch.compile of the whole model ("auto": all keep)
        self.planned: SavedBytes | None = None  # the forward measured on fake tensors (dry_run.py)
        self._planned_dims: list | None = []  # each input's largest shape measured (None: it cannot be)
        self._planned_blocks: list = []  # the blocks it names
        self._planned_for: tuple | None = None  # (what blocks needed at least, the budget) when it was chosen
        self._plan_kept: set | None = None  # the blocks the plan keeps, for the pass it was made at
        stats.activations_policy = policy

    @property
    def all_kept(self) -> bool:
        """Every block keeps its activations this pass ("auto")."""
        return self._compiled_whole or self._kept_all

    # ------------------------------------------------------------ the plan
    def plan_pass(self, args, kwargs) -> None:
        """A training forward is about to start at the root: at the first one,
        or when an input has a dimension larger than any measured (a larger
        batch, a longer sequence), measure what it saves; then, and whenever
        what blocks need at least (the optimizer's state appeared) or the
        budget changed, choose the policy (see the Note). Raises
        `BudgetError` (before the forward runs) where none holds.

        Args:
            args, kwargs: what the root forward was called with.
        """
        if self._planned_dims is None or self.measure is None:
            return
        shapes = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if _exceeds(shapes, self._planned_dims):
            try:
                self.planned, self._planned_blocks = self.measure(args, kwargs)
            except ValueError as e:
                self._planned_dims = None
                if self.asked == AUTO:
                    self._set_policy(RECOMPUTE)
                log.info("pager: %s; the first training pass learns what activations hold as it runs", str(e)[7:])
                return
            self._planned_dims = _widest(shapes, self._planned_dims)
        elif (self.least_bytes(), self.budget_bytes()) == self._planned_for:
            return
        planned = self.planned
        assert planned is not None  # (measured whenever `_planned_dims` is set)
        try:
            self._decide(planned, self._planned_blocks)
        except BudgetError:
            self._planned_dims = []  # (a smaller batch is measured again)
            raise

    def step_attaches(self) -> None:
        """An optimizer was attached after the last plan (at its first step):
        its state counts now, before that step changes anything. Raises
        `BudgetError` where no policy holds the blocks with it beside the
        activations the last forward measured."""
        if self.planned is None or self._planned_for is None:
            return  # (no forward planned yet: the first one counts the state)
        if (self.least_bytes(), self.budget_bytes()) != self._planned_for:
            self._decide(self.planned, self._planned_blocks, at_step=True)

    def _decide(self, planned: SavedBytes, blocks: list, at_step: bool = False) -> None:
        """Choose the kept blocks and the policy of the others from `planned`
        and check that the budget holds them; nothing changes if it does not
        (`at_step`: asked at an optimizer's first step, not at a forward)."""
        budget, least = self.budget_bytes(), self.least_bytes()
        room = None if budget is None else budget - least  # what activations may hold beside blocks
        kw = {"min_bytes": self.offload.min_bytes, "copies": self.transport.is_cuda}
        chosen = choose(planned, self.asked if self.asked == AUTO else self.policy, self.spare_bytes(), room, **kw)
        if chosen is None:
            raise self._refusal(planned, budget, least, kw, at_step)
        kept, policy, held = chosen
        by_name = {b.name: b for b in blocks}
        self._planned_for = (least, budget)
        if self.asked == AUTO:  # (what the first pass keeps: `pass_starts`)
            self._plan_kept = {by_name[n] for n in kept if n in by_name}
        if self.asked == AUTO:
            self._set_policy(policy)
        for name, nbytes in zip(planned.names, planned.saved):
            if name in by_name:  # (what the coming pass saves, until it has run)
                self.saved_bytes[by_name[name]] = nbytes
        if not self.offload.order:
            order = [n for k, n in enumerate(planned.order) if k == 0 or planned.order[k - 1] != n]
            self.offload.order = [by_name[n] for n in order if n in by_name]  # (as its forward will record it)
        self.ledger.plan(held)
        log.info(
            "pager: activations=%r: %s for the blocks that do not keep theirs (%d keep), at most %s of activations "
            "beside the %s that blocks need at least, in a budget of %s",
            self.asked,
            self.public_policy,
            len(kept),
            format_bytes(held),
            format_bytes(least),
            "no bound" if budget is None else format_bytes(budget),
        )

    def _refusal(self, planned: SavedBytes, budget: int, least: int, kw, at_step: bool) -> BudgetError:
        held = {p: planned.peak(p, (), **kw) for p in (OFFLOAD_VIEWS_KEPT, OFFLOAD, RECOMPUTE)}
        mine = held[self.policy] if self.asked != AUTO else min(held.values())
        if self.asked == AUTO:  # (either way of offloading)
            held[OFFLOAD] = min(held[OFFLOAD], held[OFFLOAD_VIEWS_KEPT])
        del held[OFFLOAD_VIEWS_KEPT]
        holds = [p for p, n in held.items() if least + n <= budget]
        out, staging = self.outside_bytes(), self.budget_total() - budget - self.outside_bytes()
        outside = f" less the {format_bytes(out)} the process holds on the device outside pager" if out else ""
        outside += f" less the {format_bytes(staging)} of staging for compressed pages" if staging else ""
        out += staging
        fix = (
            f'activations="{holds[0]}", which holds this budget'
            if holds
            else f"a budget of at least {format_bytes(out + least + min(held.values()), up=True)} "
            '(activations="auto" or '
            f'"{min(held, key=lambda p: held[p])}"), or a smaller batch'
        )
        unchanged = (
            "This step did not run: nothing was updated (its gradients are kept; step again once the budget holds)"
            if at_step
            else "This forward did not run"
        )
        inference = (
            ""
            if at_step
            else " If this forward is inference, run it under `torch.no_grad()` (or `torch.inference_mode()`): a "
            "forward with gradients enabled is planned as a training step, with what it saves for its backward."
        )
        return BudgetError(
            f"pager: a training step of this model with these inputs holds at least {format_bytes(least + mine)} "
            f"on the device: blocks at least {format_bytes(least)} (the resident remainder and the largest block "
            f"with their gradients and optimizer state, and what pager keeps beside them) + activations "
            f"{format_bytes(mine)} (activations={self.asked!r}; offload holds {format_bytes(held[OFFLOAD])}, "
            f"recompute {format_bytes(held[RECOMPUTE])}), more than the budget of {format_bytes(budget + out)}"
            f"{outside}. {unchanged}. Use {fix}. (The optimizer's state counts once it is attached: "
            f"`wrap(..., optimizer=opt)` counts it from the first forward; `pager.plan(model, budget, inputs=..., "
            f"optimizer=...)` gives these figures before wrap.){inference}",
            least_budget_bytes=out + least + mine,
        )

    # ------------------------------------------------------------ each pass
    def pass_starts(self) -> None:
        """A training forward starts at the root, before its first block:
        "auto" chooses what stays."""
        self.offload.forward_reaches(None)
        if self.asked != AUTO:
            return
        if self._plan_kept is not None:  # the pass the plan was made for keeps what the plan keeps
            self.kept, self._plan_kept = self._plan_kept, None
            self.kept_bytes = sum(self.saved_bytes.get(b, 0) for b in self.kept)
            self._kept_all = bool(self.kept) and self.kept >= set(self.offload.order)
            self.stats.activations_kept_blocks = len(self.kept)
        else:
            self._choose_kept()
        self.stats.activations_policy = KEEP if self.all_kept else self.public_policy

    def _choose_kept(self) -> None:
        """The blocks whose activations stay this pass (see the Note)."""
        others = max(self.ledger.last_pass_peak - self.kept_bytes, 0)  # what the rest held, last pass
        room = self.spare_bytes() - others
        self.kept, self.kept_bytes, self._kept_all = set(), 0, False
        for block in reversed(self.offload.order):
            nbytes = self.saved_bytes.get(block)
            if nbytes is None or self.kept_bytes + nbytes > room:
                break
            self.kept.add(block)
            self.kept_bytes += nbytes
        else:
            self._kept_all = bool(self.kept)
        self.stats.activations_kept_blocks = len(self.offload.order) if self._compiled_whole else len(self.kept)

    def last_pass_bytes(self) -> int | None:
        """What the last training forward's blocks saved on the device (each
        storage once), all of them kept; None before one was measured (on
        fake tensors, or run)."""
        order = dict.fromkeys(self.offload.order)  # (a block used twice saved its uses' sum)
        if not order or any(b not in self.saved_bytes for b in order):
            return None
        return sum(self.saved_bytes[b] for b in order)

    def forward_saved(self, block, nbytes: int) -> None:
        """`block`'s training forward saved `nbytes` on the device (each storage once)."""
        self._saving[block] = self._saving.get(block, 0) + nbytes

    def pass_ends(self) -> None:
        """A backward ended."""
        self.offload.pass_ends()
        self.saved_bytes.update(self._saving)  # (a block a pass did not use keeps its last measure)
        self._saving.clear()
        self.ledger.pass_ends()

    def _set_policy(self, policy: str) -> None:
        self.policy = policy
        self.offload.views = policy != OFFLOAD_VIEWS_KEPT

    @property
    def public_policy(self) -> str:
        """The policy as `stats()` names it ("offload" for both ways of offloading)."""
        return OFFLOAD if self.policy == OFFLOAD_VIEWS_KEPT else self.policy

    def forward_reaches(self, block) -> None:
        """The training forward enters `block`."""
        self.offload.forward_reaches(block)

    def between_blocks(self):
        """The `offload` and `recompute` of ops outside blocks (what they save belongs to the block before)."""
        return (self.offload if self.policy != RECOMPUTE and not self.all_kept else None), None

    def for_block(self, block, args, kwargs):
        """The `offload` and `recompute` of `block`'s training forward."""
        if block in self.kept or self._compiled_whole or self.offload.stays(block):
            return None, None
        if block.under_compile and getattr(block.module, "_compiled_call_impl", None) is None:
            if self.asked == AUTO:
                self._compiled_whole = True
                log.warning(
                    "pager: the model runs under torch.compile of the whole model, where activations can be "
                    'neither offloaded nor recomputed: activations="auto" keeps them all on the device, '
                    "within the budget (blocks get less room). Compile the blocks themselves "
                    "(`module.compile()` on each) to let it offload or recompute them."
                )
                return None, None
            raise RuntimeError(
                f"pager: block {block.name!r} runs compiled by torch.compile of the whole model, with its "
                f"activations {'recomputed' if self.policy == RECOMPUTE else 'offloaded'} (activations="
                f"{self.asked!r}): pager's saved-tensor hooks are not for graphs compiled that way (a "
                "recomputation, in the backward, would not run compiled). Compile the blocks themselves "
                "instead (`module.compile()` on each, before or after wrap), or keep activations "
                '(activations="keep"); see [Note: pager under torch.compile] in model/hooks.py.'
            )
        if self.policy == RECOMPUTE:
            return None, Recompute(block, args, kwargs, self.stats, self.ledger)
        return self.offload, None

    def backward_reaches(self, block) -> None:
        self.offload.backward_reaches(block)


class Sent:
    """An activation on the host, as the graph holds it (see the Note); one
    for every save of the same tensor in a block's forward."""

    __slots__ = (
        "offload",
        "host",
        "written_event",
        "device",
        "ready_event",
        "saves",
        "left",
        "handed",
        "outgoing",
        "reused",
        "__weakref__",
    )

    def __init__(self, offload, host, written_event):
        self.offload, self.host, self.written_event = offload, host, written_event
        self.device = None  # brought back ahead of the backward, not yet asked for
        self.ready_event = None  # `device` holds the bytes (h2d), or its copy out has read them (`reused`)
        self.outgoing = None  # the device tensor's `_Outgoing` while it is held for its copy out
        self.reused = False  # `device` is the forward's own tensor, not a copy
        self.saves = self.left = 1  # saves that hold it; of those, unpacks still to come in this backward
        self.handed = None  # the device copy given to autograd, while other saves will ask for it

    def unpack(self):
        return self.offload.bring(self)

    def __del__(self):
        transport = self.offload.transport
        if self.device is not None:  # brought, never asked for (the graph went): may still be landing
            (transport.forget_sent if self.reused else transport.forget_brought)(self.device)
            self.offload.ledger.sub(_nbytes(self.device))
        elif self.handed is not None:
            self.offload.ledger.sub(_nbytes(self.handed))
        transport.give_host(self.host)  # (no view of it is left; a copy in still reading it is waited for: the Note)


class _Outgoing:
    """A device tensor held until its copy out (`event`) has read it."""

    __slots__ = ("tensor", "event", "nbytes", "version", "sent")

    def __init__(self, tensor, event, nbytes: int, sent):
        self.tensor, self.event, self.nbytes = tensor, event, nbytes
        self.version = tensor._version  # (reused only unchanged since it was saved)
        self.sent = weakref.ref(sent)


class ActivationOffload:
    """Sends the activations that forwards save to pinned host memory and
    brings them back for the backward ([Note: activations off the device]).

    Args:
        transport: the pager's transport (its streams and copies).
        stats: the pager's `Stats` (activations_* counters).
        ledger: the `Ledger` of device bytes (being copied out, brought back).
        min_bytes: activations smaller than this stay on the device.
        keep_last: the last blocks of a forward (in the previous forward's
            order) whose activations stay on the device.
    """

    def __init__(self, transport, stats, ledger, min_bytes: int = OFFLOAD_MIN_BYTES, keep_last: int = KEEP_LAST_BLOCKS):
        self.transport = transport
        self.stats = stats
        self.ledger = ledger
        self.min_bytes = min_bytes
        self.keep_last = keep_last
        self.views = True  # saved views that are not contiguous but dense leave too ("auto" may keep them)
        self.bring_ahead = BRING_AHEAD_BLOCKS
        self._order: list = []  # blocks in the order this forward reached them
        self.order: list = []  # ... the last forward did
        self._stay: set = set()  # blocks whose activations stay (the last ones of the previous forward)
        self._lock = threading.Lock()  # unpack runs on autograd's threads
        self._groups: list = []  # [block, [weakref to Sent], bytes] per forward of a block, in forward order
        self._forward_block = None  # the block whose forward ran last: what is saved now belongs to it
        self._by_view: dict = {}  # what the last group sent, by view (`_sent_already`)
        # Device tensors being copied out, oldest first (`_Outgoing`);
        # their bytes are the ledger's `flight`, their cap its `flight_cap`.
        self._in_flight: deque = deque()

    def forward_reaches(self, block) -> None:
        """The forward enters `block` (None: a new forward, before its first block)."""
        if block is None:
            # The last blocks' activations are the backward's first need:
            # sending them out and straight back would only cost link time.
            self.order = self._order or self.order
            self._stay = set(self.order[-self.keep_last :]) if self.keep_last else set()
            self._order = []
            self.ledger.sending = True
        elif not self._order or self._order[-1] is not block:
            self._order.append(block)
        self._forward_block = block

    def stays(self, block) -> bool:
        """Whether `block`'s activations stay on the device (one of the last of a forward)."""
        return block in self._stay

    def wants(self, t) -> bool:
        return (
            self._forward_block not in self._stay
            and t.device == self.transport.device
            and t.layout == torch.strided
            and (t.is_contiguous() or self.views and _dense(t))
            and _nbytes(t) >= self.min_bytes
        )

    def send(self, t) -> Sent:
        again = self._sent_already(t)
        if again is not None:
            return again
        with unguarded():
            host, written = self.transport.send_to_host(t)
        sent = Sent(self, host, written)
        nbytes = _nbytes(host)
        with self._lock:
            block = self._forward_block
            if not self._groups or self._groups[-1][0] is not block:
                self._prune()
                self._groups.append([block, [], 0])
                self._by_view.clear()
            self._by_view[_view_key(t)] = (weakref.ref(t.untyped_storage()), t._version, weakref.ref(sent))
            group = self._groups[-1]
            group[1].append(weakref.ref(sent))
            group[2] += nbytes
            self.stats.activations_sent_bytes += nbytes
            if written is not None:  # (else the copy is done: nothing in flight, no cap to count)
                # The cap grows to the largest block's activations.
                self.ledger.flight_cap = max(IN_FLIGHT_MIN_BYTES, self.ledger.flight_cap, group[2])
                # Its memory, not its graph: a graph node's hooks hold the pager,
                # which holds this queue (a cycle through C++ that gc cannot break).
                with unguarded():
                    sent.outgoing = _Outgoing(t.detach(), written, nbytes, sent)
                self._in_flight.append(sent.outgoing)
                self.ledger.add(nbytes, flight=nbytes)
            self._settle()
        return sent

    def _sent_already(self, t):
        """The `Sent` of the same view of the same storage, unchanged, saved
        before in this block's forward (a norm's output saved by q, k and v):
        it is copied once and brought back once for all of its saves."""
        with self._lock:
            if not self._groups or self._groups[-1][0] is not self._forward_block:
                return None
            entry = self._by_view.get(_view_key(t))
            # The storage object itself (not its address, which a new tensor may reuse) and its version.
            sent = (
                entry[2]()
                if entry is not None and entry[0]() is t.untyped_storage() and entry[1] == t._version
                else None
            )
            if sent is not None:
                sent.saves += 1
                sent.left += 1
            return sent

    def _settle(self, cap: int | None = None) -> None:
        """Let go of device tensors whose copy out is done; past `cap` (the
        in-flight cap by default), of the oldest ones anyway, compute first
        waiting for their copy (so that the memory may be reused at once: see
        [Note: activations off the device])."""
        q, ledger = self._in_flight, self.ledger
        while q and q[0].event.query():
            self._let_go(q.popleft())
        cap = max(IN_FLIGHT_MIN_BYTES, ledger.flight_cap) if cap is None else cap
        while ledger.flight > cap:
            out = q.popleft()
            # Compute reuses this memory only after the copy out has read it.
            self.transport.compute_waits(out.event)
            self._let_go(out)

    def _let_go(self, out: _Outgoing) -> None:
        self.ledger.sub(out.nbytes, flight=out.nbytes)
        sent = out.sent()
        if sent is not None:
            sent.outgoing = None

    def pass_ends(self) -> None:
        """The backward ended: every copy out was ordered before it; compute
        waits for those still under way, and their device memory is let go."""
        with self._lock:
            self._settle(cap=0)

    def bring(self, sent: Sent) -> torch.Tensor:
        with self._lock:
            device = sent.handed
            if device is None:
                if sent.device is None:
                    self._start_bringing(sent)
                elif not sent.reused:
                    self.stats.activations_ahead_bytes += _nbytes(sent.host)
                device, event = sent.device, sent.ready_event
                sent.device = sent.ready_event = None  # the backward holds it now; freed after its use
                # Brought: the bytes must have landed (a later save's unpack
                # gets it after this wait). Reused: compute frees it after its
                # use, and reuses the memory only after the copy out has read it.
                self.transport.compute_waits(event)
            sent.left -= 1
            sent.handed = device if sent.left > 0 else None  # kept for the saves still to ask
            if sent.left <= 0:
                sent.left = sent.saves  # (a retained graph's next backward asks again)
                self.ledger.sub(_nbytes(device))
        return device

    def backward_reaches(self, block) -> None:
        """`block`'s backward is about to run: bring its activations and the
        previous block's (next backward) ahead of autograd's asking."""
        with self._lock:
            self.ledger.sending = False  # (the forward is over: the queue only drains)
            i = next((i for i in range(len(self._groups) - 1, -1, -1) if self._groups[i][0] is block), None)
            if i is None:
                self._settle()
                return
            coming = [
                sent
                for _block, refs, _nbytes_ in self._groups[max(i - self.bring_ahead, 0) : i + 1]
                for sent in (ref() for ref in refs)
                if sent is not None and sent.device is None and sent.handed is None
            ]
            for sent in coming:  # (before `_settle` lets them go: used where they are)
                if sent.outgoing is not None:
                    self._start_bringing(sent)
            self._settle()
            for sent in coming:
                if sent.device is None:
                    self._start_bringing(sent)
            # Done with; so is the one before, if it is of ops before the first block.
            del self._groups[i - 1 if i and self._groups[i - 1][0] is None else i : i + 1]

    def _start_bringing(self, sent: Sent) -> None:
        """`sent` to the device: the forward's own tensor if it is still there
        for its copy out and unchanged (see the Note), else a copy in."""
        out = sent.outgoing
        if out is not None and out.tensor._version == out.version:
            self._in_flight.remove(out)
            sent.outgoing = None
            sent.device, sent.ready_event, sent.reused = out.tensor, out.event, True
            self.ledger.sub(0, flight=out.nbytes)  # (no longer counted as copied out: held for the backward)
            self.stats.activations_reused_bytes += out.nbytes
            return
        sent.device, sent.ready_event = self.transport.bring_to_device(sent.host, sent.written_event)
        sent.reused = False
        self.stats.activations_brought_bytes += _nbytes(sent.host)
        self.ledger.add(_nbytes(sent.host))

    def _prune(self) -> None:
        """Forget forwards whose graph is gone (no backward came)."""
        self._groups = [g for g in self._groups if any(r() is not None for r in g[1])]


class Dropped:
    """A dropped activation, as the graph holds it ([Note: activations recomputed])."""

    __slots__ = ("recompute", "index", "shape", "dtype", "__weakref__")

    def __init__(self, recompute, index, shape, dtype):
        self.recompute, self.index, self.shape, self.dtype = recompute, index, shape, dtype

    def unpack(self):
        return self.recompute.value(self)


def recomputing() -> bool:
    """True in a thread that runs a block's forward again for its backward."""
    return getattr(tls, "recording", None) is not None


class Recompute:
    """One training forward of a block, to run again in its backward for the
    activations it dropped ([Note: activations recomputed]).

    Args:
        block: the block (its `module` is called again; `name` in errors).
        args, kwargs: what its forward was called with.
        stats: the pager's `Stats` (recomputes, activations_recomputed_bytes).
        ledger: the `Ledger` (the inputs kept, values recomputed and not yet handed out).
    """

    def __init__(self, block, args, kwargs, stats, ledger):
        self.block, self.stats, self.ledger = block, stats, ledger
        self.held, self.values, self.keys = [], {}, {}  # (for __del__, should what follows raise)
        flat, self.spec = tree_flatten((args, kwargs))
        with unguarded():
            self.inputs = [_Input(t) if isinstance(t, torch.Tensor) else t for t in flat]
            self.held = [
                ledger.hold(x.tensor)
                for x in self.inputs
                if isinstance(x, _Input) and entry_of(x.tensor) is None and x.tensor.device == ledger.device
            ]
        self.devices = sorted({t.device.index or 0 for t in flat if isinstance(t, torch.Tensor) and t.is_cuda})
        self.rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices])
        self.autocast = [
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")
            if kind == "cpu" or self.devices
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.holders: list = []  # weakref to each Dropped, in the order the forward saved them
        self.dropped_bytes = 0  # what they held
        self.first_save = getattr(tls, "saves", 0)  # this thread's saves before the forward's first
        self.index_of: dict = {}  # the forward's n-th save -> the index of the Dropped it made
        self.values: dict = {}  # index -> recomputed tensor, until handed out
        self.keys: dict = {}  # index -> its key in the ledger (`Ledger.hold`)
        self.lock = threading.Lock()  # unpack runs on autograd's threads
        with unguarded():  # ([Note: buffers a forward changes])
            self.buffers = [(b, b._version) for b in block.module.buffers()] if block.module is not None else []
        # ([Note: caches a forward writes])
        self.cache_layers = [(layer, dict(vars(layer))) for t in flat for layer in _cache_layers(t)]

    def drop(self, t, number: int) -> Dropped:
        """Drop `t`, the thread's `number`-th save."""
        dropped = Dropped(self, len(self.holders), t.shape, t.dtype)
        self.index_of[number - self.first_save] = dropped.index
        self.holders.append(weakref.ref(dropped))
        nbytes = _nbytes(t)  # (what `keep` will count)
        self.dropped_bytes += nbytes
        self.ledger.dropped[self.block] = self.ledger.dropped.get(self.block, 0) + nbytes
        return dropped

    def value(self, dropped: Dropped) -> torch.Tensor:
        with self.lock:
            if dropped.index not in self.values:
                self._run()
            t = self.values.pop(dropped.index)
            key = self.keys.pop(dropped.index)
        self.ledger.let_go(key)  # autograd holds it now
        return t

    def __del__(self):  # the graph let go of every `Dropped`: the inputs and unused values go
        for key in self.held:
            self.ledger.let_go(key)
        for key in self.keys.values():
            self.ledger.let_go(key)

    def _run(self) -> None:
        """Run the block's forward again, keeping what it saves for the
        `Dropped` still alive (and not yet handed out)."""
        args, kwargs = tree_unflatten(
            [x.get(self.block) if isinstance(x, _Input) else x for x in self.inputs], self.spec
        )
        rng_now = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices])
        _set_rng(self.rng, self.devices)
        stats = self._stats() if self.buffers else set()
        changed = [(b, b.clone()) for b, version in self.buffers if b._version != version or id(b) in stats]
        written = _put_back(self.cache_layers)
        tls.recording = (self, [0])
        torch._C._autograd._push_saved_tensors_default_hooks(*_AGAIN_HOOKS)
        try:
            with torch.enable_grad(), _autocast(self.autocast, self.autocast_cache):
                self.block.module(*args, **kwargs)
        except _AllSaved:
            pass
        finally:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            tls.recording = None
            _set_rng(rng_now, self.devices)
            with torch.no_grad():
                for buffer, before in changed:
                    # (the forward changed it once already; through .data: the recomputed graph may
                    # have saved it, at the version it has)
                    buffer.data.copy_(before)
            _put_back(written)
            self.ledger.recomputed(self.dropped_bytes)
        missing = [i for i, ref in enumerate(self.holders) if ref() is not None and i not in self.values]
        if missing:
            raise RuntimeError(
                f"pager: block {self.block.name!r} saved {len(self.holders)} tensors for its backward in its "
                f'forward but fewer when run again (activations="recompute"): its forward must save the same '
                "tensors each time it runs (no control flow on values or on global state that changes); use "
                'activations="offload" or "keep" for this model.'
            )
        self.stats.recomputes += 1

    def _stats(self) -> set:
        """ids of the block's running statistics (BatchNorm's, InstanceNorm's):
        their kernel updates them without moving their version."""
        return {
            id(b)
            for m in self.block.module.modules()
            if isinstance(m, torch.nn.modules.batchnorm._NormBase)
            for b in (m.running_mean, m.running_var)
            if b is not None
        }

    def keep(self, i: int, t) -> None:
        """The recomputation saved `t` as its `i`-th tensor."""
        ref = self.holders[i]() if i < len(self.holders) else None
        if ref is None or i in self.values:
            return
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise RuntimeError(
                f"pager: block {self.block.name!r} saved a tensor of shape {list(ref.shape)} and {ref.dtype} as its "
                f"#{i} for its backward in its forward, but {list(t.shape)} and {t.dtype} when run again "
                '(activations="recompute"): its forward must save the same tensors each time it runs; use '
                'activations="offload" or "keep" for this model.'
            )
        self.values[i] = t
        self.keys[i] = self.ledger.hold(t)  # (by storage: a tensor saved twice, or the input kept, counts once)
        self.stats.activations_recomputed_bytes += _nbytes(t)


class _Input:
    """An input of a recomputed forward: a detached alias and its version
    (a block's own weights and other paged tensors: the tensor itself)."""

    __slots__ = ("tensor", "version", "requires_grad")

    def __init__(self, t):
        self.tensor = t if entry_of(t) is not None else t.detach()
        self.version, self.requires_grad = t._version, t.requires_grad

    def get(self, block) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"pager: an input of block {block.name!r} of shape {list(self.tensor.shape)} was changed in place "
                'after its forward, and the block\'s activations are recomputed from it (activations="recompute"): '
                'change a copy (`.clone()`) instead, or use activations="offload" or "keep".'
            )
        if entry_of(self.tensor) is not None:
            return self.tensor
        return self.tensor.detach().requires_grad_(self.requires_grad)


def _cache_layers(x) -> list:
    """The layers of `x` if it is a transformers KV cache (`Cache`: a
    `layers` list, `update`, `get_seq_length`), else none."""
    layers = getattr(x, "layers", None) if hasattr(x, "get_seq_length") and hasattr(x, "update") else None
    return [layer for layer in layers if hasattr(layer, "__dict__")] if isinstance(layers, list) else []


def _put_back(noted: list) -> list:
    """Give each layer of `noted` ((layer, its attributes)) those attributes
    where it has others now; return what those layers had."""
    out = []
    for layer, attributes in noted:
        now = vars(layer)
        if now.keys() != attributes.keys() or any(now[k] is not v for k, v in attributes.items()):
            out.append((layer, dict(now)))
            now.clear()
            now.update(attributes)
    return out


def _exceeds(shapes: list, widest: list) -> bool:
    """Whether an input of `shapes` is larger in a dimension than `widest` (or laid out otherwise)."""
    if len(shapes) != len(widest):
        return True
    return any(len(a) != len(b) or any(x > y for x, y in zip(a, b)) for a, b in zip(shapes, widest))


def _widest(shapes: list, widest: list) -> list:
    """Each input's largest shape of `shapes` and `widest`."""
    if len(shapes) != len(widest):
        return shapes
    return [a if len(a) != len(b) else tuple(max(x, y) for x, y in zip(a, b)) for a, b in zip(shapes, widest)]


def _pack_again(t):
    # [Note: saves counted across nested blocks]
    # A block's forward may run blocks inside it (a layer's parts): what
    # those save is theirs (their own `Recompute`, offload or ledger), not
    # the outer block's. Running the outer forward again runs the inner ones
    # too, under these hooks alone, so its saves are matched by number: the
    # n-th save since the forward began, whoever's frame took it, both times.
    recompute, counter = tls.recording
    n = counter[0]
    counter[0] += 1
    with unguarded():
        t = t.detach()
    index = recompute.index_of.get(n)
    if index is None:
        entry = entry_of(t)
        if entry is not None:  # (a block's weight, saved as it is) counted, as in the forward
            entry[2].saved.append(weakref.ref(t))  # ([Note: autograd's saved views, counted] in base/saving.py)
        return t
    recompute.keep(index, t)
    if index == len(recompute.holders) - 1 and not _cuda_trace_hooks_on():
        raise _AllSaved  # the rest of the forward saves nothing the backward needs
    return t


def _cuda_trace_hooks_on() -> bool:
    """Whether torch's CUDA sanitizer watches (see [Note: activations recomputed])."""
    sanitizer = sys.modules.get("torch.cuda._sanitizer")
    return sanitizer is not None and getattr(getattr(sanitizer, "cuda_sanitizer", None), "enabled", False)


class _AllSaved(Exception):
    """Ends a recomputation once it has saved all that the forward saved."""


def _unpack_again(t):
    return t


_AGAIN_HOOKS = (outside_compile(_pack_again), outside_compile(_unpack_again))  # (see saving._HOOKS)


def _set_rng(states, devices) -> None:
    torch.set_rng_state(states[0])
    for d, state in zip(devices, states[1]):
        torch.cuda.set_rng_state(state, d)


@contextmanager
def _autocast(states, cache: bool):
    """The forward's autocast state (autograd's thread has its own)."""
    with ExitStack() as stack:
        for kind, enabled, dtype in states:
            stack.enter_context(torch.amp.autocast(kind, enabled=enabled, dtype=dtype, cache_enabled=cache))
        yield


def _view_key(t) -> tuple:
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _nbytes(t) -> int:
    return t.numel() * t.element_size()
