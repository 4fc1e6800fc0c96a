"""What the process holds on the device outside pager, for a budget that
covers the whole process (`wrap(..., budget_covers="process")`):
`Outside`, one per wrapped model.

[Note: a budget that covers the process]
The budget bounds what pager holds (blocks, the activations its hooks
keep, the state a forward carries) and, with `budget_covers="process"`,
what the process holds on the device beside it: the forward's inputs and
output, and a loss over it. A language model's loss over 4x1024 tokens of
a 32000-word vocabulary holds three float32 tensors of the logits' size at
once in its backward (the log-softmax's output, its gradient and the
logits' gradient: 1.5 GiB), beside everything pager holds at the forward's
end. So blocks get the budget less what the process holds outside pager
(`outside_bytes`), and the allocator's peak stays within the budget but for
a block's temporaries while it runs. It is the default;
`budget_covers="pager"` leaves that to the caller (a test that sizes its
budget in blocks and keeps a reference model on the same device).

Before the first training step it is predicted, from the forward measured
on fake tensors ([Note: what sits outside pager, predicted] in
training/dry_run.py), the most of the inputs measured since the last
refusal; that is all the CPU device knows. On CUDA it is then also
learned (below): `outside_bytes` is the larger of the two.

It is read from the caching allocator's counters, a few times a pass and
never per block use: at the root forward's start (what the caller holds
before any block is fetched: its inputs, tensors and models of its own, so
an inference forward leaves them room from the first), at its end (the
output besides) and when the backward reaches the model's first block.
Between the last two, pager's hooks do not run, so what pager holds is
what it held at the forward's end; if the allocator's peak
moved in between (the loss and its backward, where the peak of a step
usually is), the process held the new peak less that, outside pager. A peak
that does not move says nothing, so `wrap` resets the device's peak
counter (as `torch.cuda.reset_peak_memory_stats` does; read it again after
`wrap` if you measure it), unless another model on the device is between
its forward's end and its backward (the reset would hide its loss);
pager itself never resets it otherwise, and reading it is yours as before.
What is seen counts as held on the device by every wrapped model there,
each engine under a budget of its own, and by the caller (not the other
models' blocks: two models wrapped apart do not crowd each other). What
is learned is the larger of what the caller holds when a forward starts
with the most a forward added to it by its end (its output), and the most
seen from a forward's end to its backward (a loss, whole). The first is
read again at each forward on the device, for every model there (a tensor
let go of no longer counts; a model of a pool that does not run keeps no
old figure); the others only grow, until a refusal: after one step with a
larger loss (a longer batch), blocks keep the smaller room. A forward
that starts on the device between another model's forward and its
backward takes that step's peak from it (its blocks would look like the
caller's). A training
forward that runs unhooked ([Note: asleep] in model/asleep.py) learns
nothing at its end: autograd holds the activations then where pager cannot
tell them from the caller's tensors. So on CUDA a model that fits trains unhooked
only where the measure predicted what sits outside pager beside the
activations it keeps (every "auto" budget; not `activations="keep"`, which
measures nothing); the forwards with hooks before it learned what the
caller holds.
"""

from __future__ import annotations

import logging

from ..base.budget import AllocatorCounter, format_bytes
from ..base.budget import allocator_counter as allocator_counter  # (wrap's, through this module: tests replace it)
from ..base.common import _PAGERS

log = logging.getLogger("pager")

COVERS = ("pager", "process")


def _pagers_on(device) -> list:
    """The `Pager` of every wrapped model on `device` (a few: not per block use)."""
    return [p for p in list(_PAGERS.values()) if p.engine.device == device]


def _outsides_on(device) -> list:
    """The `Outside` of every wrapped model on `device` that covers the process."""
    return [p.outside for p in _pagers_on(device) if p.outside is not None]


def _held_by(engine) -> int:
    """What `engine` holds on its device: its blocks, its owners' activations
    (those their hooks keep), carried state and row caches, its staging ring."""
    held = engine.resident_bytes + engine.transport.staging_bytes
    for owner in engine.owners:
        held += owner.carried_bytes + owner.row_bytes
        if owner.activations is not None:
            held += owner.activations.ledger.live
    return held


def check_covers(covers: str) -> bool:
    """Whether `budget_covers=covers` covers the process; raises for a bad value."""
    if covers not in COVERS:
        raise ValueError(
            f'pager: budget_covers={covers!r} must be "pager" (the budget bounds what pager holds: '
            'blocks, activations, carried state) or "process" (also what the process holds on the '
            "device outside pager, such as the loss)."
        )
    return covers == "process"


class Outside:
    """Learns `pager.outside_bytes` ([Note: a budget that covers the process]).

    Args:
        pager: the wrapped model's `Pager`.
        counter: the device's `AllocatorCounter` (None: the device keeps
            none, the CPU: what the dry run predicts is all it knows).
    """

    def __init__(self, pager, counter: AllocatorCounter | None):
        self.pager = pager
        self.counter = counter
        self.held_at_end: int | None = None  # what pager held at the last forward's end (None: not since)
        self.peak_at_end = 0  # the allocator's peak then
        self.prediction = 0  # the dry run's, for the last inputs measured
        self.holding = 0  # what the caller held when the last forward on the device started (read at each)
        self.grown = 0  # the most a forward added to that by its end: its output (only grows)
        self.peaked = 0  # the most seen outside pager from a forward's end to its backward: a loss (only grows)
        self.logged = 0  # the most logged at INFO
        if counter is not None and not any(o.held_at_end is not None for o in _outsides_on(pager.engine.device)):
            counter.reset_peak()  # (not under another model's step: its loss's peak would go unseen)

    @property
    def learns(self) -> bool:
        """It reads the allocator's counters (a CUDA device)."""
        return self.counter is not None

    @property
    def learned(self) -> int:
        """What the allocator's counters show outside pager at a step's peak:
        what the caller holds now with what a forward adds to it, or the
        most seen while a loss ran, the larger."""
        return max(self.holding + self.grown, self.peaked)

    def predicted(self, nbytes: int) -> None:
        """The dry run predicts `nbytes` outside pager at the coming step's
        peak ([Note: what sits outside pager, predicted] in
        training/dry_run.py): blocks leave that room from its first step.
        The most predicted holds: inputs measured before may come again,
        unmeasured (the measure runs again only where a dimension grows)."""
        self.prediction = max(self.prediction, nbytes)
        self._update("is predicted to hold")

    def refused(self) -> None:
        """A forward was refused before it ran: its inputs' prediction goes
        (the next forward is measured again: a smaller batch's counts), and
        what steps showed (the next forward's start reads again what the
        caller holds)."""
        self.prediction = self.grown = self.peaked = 0
        self._update(None)

    def held_bytes(self) -> int:
        """What pager holds on this device now: the blocks of every engine
        there (this model's pool and any other wrapped model's, each under a
        budget of its own, not the caller's), the activations their owners'
        hooks keep, carried state, row caches and staging rings."""
        own = self.pager.engine
        engines = {id(e): e for e in [own, *(p.engine for p in _pagers_on(own.device))]}  # (a pool's, once)
        return sum(map(_held_by, engines.values()))

    def forward_starts(self) -> None:
        """A root forward starts, none of this model in flight: what the
        caller holds now (its inputs, tensors of its own) is outside pager,
        seen before any block of this forward is fetched. It replaces what
        an earlier forward's start saw, for every model on the device (a
        tensor let go of no longer counts; a model of the pool that does not
        run keeps no old figure); another model's step in between its
        forward and its backward learns nothing from its peak (this
        forward's blocks would look like its caller's)."""
        if self.counter is None:
            return
        holding = max(self.counter.read()[0] - self.held_bytes(), 0)
        others = [o for o in _outsides_on(self.pager.engine.device) if o is not self]
        for outside in [self, *others]:
            outside.holding = holding
            outside._update("holds")
        for other in others:
            other.held_at_end = None  # (its backward's start learns nothing of this step)

    def forward_ended(self) -> None:
        """The root forward ended, its blocks hooked: what the caller holds now."""
        if self.counter is None:
            return
        current, self.peak_at_end = self.counter.read()
        self.held_at_end = self.held_bytes()
        if current - self.held_at_end - self.holding > self.grown:
            self.grown = current - self.held_at_end - self.holding
            self._update("holds")

    def backward_starts(self) -> None:
        """The backward reached the model's first block, before any hook's
        work: the most the process held outside pager since the forward
        ended (pager held what it held then: its hooks did not run)."""
        if self.held_at_end is None or self.counter is None:
            return
        current, peak = self.counter.read()
        seen = max(current - self.held_bytes(), peak - self.held_at_end if peak > self.peak_at_end else 0)
        self.held_at_end = None
        if seen > self.peaked:
            self.peaked = seen
            self._update("holds")

    def _update(self, how: str | None) -> None:
        """`outside_bytes` = the larger of what was learned and what was
        predicted; said at INFO where it is more than ever said before."""
        nbytes = max(self.learned, self.prediction)
        if how is not None and nbytes > self.pager.outside_bytes:
            self._warn_if_crowded(nbytes)
        self.pager.outside_bytes = nbytes
        if how is not None and nbytes > self.logged:
            self.logged = nbytes
            log.info(
                "pager: the process %s %s on the device outside %s; blocks leave it that room",
                how,
                format_bytes(nbytes),
                self.pager.name,
            )

    def _warn_if_crowded(self, nbytes: int) -> None:
        """What was seen leaves blocks less than they need (a prediction that
        does is refused before its forward instead: training/activations.py)."""
        pager = self.pager
        if pager.budget_bytes < pager.least_room + nbytes:
            pager.warn_once(
                "outside_crowd",
                "pager: what the process holds on the device outside pager (%s: the loss, the "
                "caller's tensors) leaves less of the %s budget than the %s that blocks need at least; blocks take "
                "that much anyway, so the process holds more than the budget. Raise the budget, or use a smaller "
                "batch.",
                format_bytes(nbytes),
                format_bytes(pager.budget_bytes),
                format_bytes(pager.least_room),
            )
