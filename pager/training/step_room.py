"""What an update of blocks on the device holds beside their pages, held
out of the room while it runs: `StepRoom`, one per attached optimizer.

[Note: the step's room]
A block's update on the device holds more than its pages. torch's foreach
kernels return new lists the size of the parameters (Adam's and AdamW's
`_foreach_sqrt` of the second moment: one copy of the parameters in their
state's dtype; a fused kernel none), and a block's first update creates
its state outside its page, which is then copied in: the new state and its
page at once. Uncounted, these went over the budget where activations are
small (a Qwen3-MoE layer block of 1.2 GB under 12 GiB peaked at 12.83 GiB
at its first `opt.step()`, pager's own peak 10.44). So while blocks step,
`Pager.step_bytes` holds them out of the room (engine/room.py: the larger
of it and the activations' reserve, which activations do not use then):
before the update, the temporaries and the state it will create (by the
optimizer's class: `state_bytes_of`); after it, the new state not yet in a
page, less each block's as it is adopted. Blocks that are idle leave for
it as for a fetch, before the update changes anything, and for each new
state page beside the state it is copied from; where none is left to
leave (a budget near the least), the state goes through host memory
instead: it is copied into the page's host memory (under a disk tier,
which places a page when it is first written, into host memory of its
own), the optimizer's tensors are let go, and the page is fetched as any
other (training/adoption.py: a round trip of the state over the link, at
a block's first update only).

An update deferred to its block's next use ([Note: deferred updates] in
training/optim.py) runs inside that use, in a forward, beside the
activations: room is made for its temporaries on top of everything else
before it runs (its state has its page: a first update is never
deferred), except as its block leaves (room is being made then). Blocks
that step together (every page on the device) go in runs whose
temporaries fit beside them.

The least budget counts it the same way: activations hold nothing at the
step, so a training step needs the least that blocks need with the larger
of what activations hold and the most an update of one block holds beyond
its pages with their state (`update_bytes`: its temporaries); a refusal
names that, and so does `pager.plan`'s least budget.

The temporaries are a prior, `TEMPORARIES_PRIOR` copies of the stepped
parameters in their state's dtype (float32 under master weights), none
where every group is fused. On CUDA the allocator's counters correct it
upward: around each block's first `MEASURED_STEPS` updates, a peak above
the one before the update is the update's own, and what it held beyond
what was allocated before and the new state, per stepped byte, becomes the
factor if it is more. A peak hidden under an earlier one (the loss's) says
nothing ([Note: a budget that covers the process] in model/outside.py).
"""

from __future__ import annotations

import logging

from ..base.budget import format_bytes
from ..base.registry import unguarded
from ..base.wrappers import aligned_bytes
from .dry_run import state_bytes_of
from .masters import wants_master

TEMPORARIES_PRIOR = 1.0  # copies of the stepped parameters an unfused update holds at once
MEASURED_STEPS = 2  # a block's updates read against the allocator's counters (CUDA)

log = logging.getLogger("pager")


class StepRoom:
    """The room an optimizer's updates on the device take beside the pages
    ([Note: the step's room]).

    Args:
        pager: the wrapped model's `Pager` (its `step_bytes` is set here).
        optimizer: the attached optimizer.
        counter: the device's `AllocatorCounter`, or None (the CPU).
        stateless: the ids of blocks whose updates make no state.
    """

    def __init__(self, pager, optimizer, counter, stateless: set):
        self.pager, self.optimizer, self.counter = pager, optimizer, counter
        self.stateless = stateless  # id of each block whose update made no state (`OptimizerLink.stateless`)
        fused = all(g.get("fused") for g in optimizer.param_groups)
        self.factor = 0.0 if fused else TEMPORARIES_PRIOR
        self._measured: dict[int, int] = {}  # id(block) -> its updates read against the counters
        self._held = 0  # what this room holds in `Pager.step_bytes` now
        self._before: tuple[int, int] | None = None  # the counters before the update being read

    def _stepped(self, blocks, shares) -> list:
        return [p for b in blocks for share in shares[id(b)] for p in share]

    def _one_bytes(self, params) -> int:
        """Bytes of one state-sized copy of `params` (float32 where a master stands for them)."""
        master = self.pager.master_weights
        with unguarded():  # (read past the guards: see model/step_needs.py)
            return sum(4 * p.numel() if master and wants_master(p) else aligned_bytes(p) for p in params)

    def temporaries(self, blocks, shares) -> int:
        """What the update of `blocks` (their parameters by group: `shares`)
        holds at once beyond its pages and new state: its temporaries."""
        return int(self.factor * self._one_bytes(self._stepped(blocks, shares)))

    def before(self, blocks, shares) -> None:
        """Hold out of the room what the update of `blocks` will hold beside
        their pages: its temporaries and the state a first update makes (by
        the optimizer's class, with each group's options: the groups' own
        parameters are narrowed to the block stepped before)."""
        first = [b for b in blocks if "state" not in b.segments and id(b) not in self.stateless]
        fresh = 0
        if first:  # (once a block: its first update)
            groups = self.optimizer.param_groups
            group_of = {id(p): groups[gi] for b in first for gi, share in enumerate(shares[id(b)]) for p in share}
            state_of = state_bytes_of(
                self.optimizer, self.pager.device, master_weights=self.pager.master_weights, groups=group_of
            )
            fresh = sum(map(state_of, self._stepped(first, shares)))
        self._hold(fresh + self.temporaries(blocks, shares))

    def _hold(self, nbytes: int) -> None:
        """Hold `nbytes` in `Pager.step_bytes` in place of what this room held."""
        self.pager.step_bytes += nbytes - self._held
        self._held = nbytes

    def measure(self, blocks) -> None:
        """The update of `blocks` starts now (their pages allocated): read the
        allocator's counters if it is one of theirs still to be measured."""
        measured = self.counter is not None and any(self._measured.get(id(b), 0) < MEASURED_STEPS for b in blocks)
        self._before = self.counter.read() if measured else None

    def ran(self, blocks, shares, fresh_bytes: int, hold: bool = True) -> None:
        """The update ran, creating `fresh_bytes` of state outside the pages:
        learn the temporaries from the counters (if read), and hold the new
        state until it is adopted (`adopted`)."""
        if hold:
            self._hold(fresh_bytes)
        if self._before is None:
            return
        (allocated, peak_before), (_now, peak) = self._before, self.counter.read()
        self._before = None
        for b in blocks:
            self._measured[id(b)] = self._measured.get(id(b), 0) + 1
        stepped = self._one_bytes(self._stepped(blocks, shares))
        if peak <= peak_before or not stepped:
            return  # (hidden under an earlier peak: it says nothing)
        factor = (peak - allocated - fresh_bytes) / stepped
        if factor > self.factor:
            log.info(
                "pager: an update of %s held %s beyond its pages and new state (%.2f copies of its parameters, "
                "%.2f assumed): held out of the room from now on",
                blocks[0].name if len(blocks) == 1 else f"{len(blocks)} blocks",
                format_bytes(peak - allocated - fresh_bytes),
                factor,
                self.factor,
            )
            self.factor = factor

    def update_bytes(self, block, trained: set) -> int:
        """What an update of `block` on the device holds beyond its pages
        with their state (`step_needs.train_bytes`): its temporaries (a first
        update's new state stands for its page until adopted); none where
        updates run on the host, but the first. `trained`: the ids of the
        parameters the optimizer updates."""
        pager = self.pager
        if pager.host_steps.mode == "host" and ("state" in block.segments or id(block) in self.stateless):
            return 0  # (only a first update runs on the device)
        rows, experts = pager.row_params, pager.expert_params
        params = [p for p in block.params if id(p) in trained and id(p) not in rows and id(p) not in experts]
        return int(self.factor * self._one_bytes(p for p in params if p.requires_grad))

    def adopted(self, nbytes: int) -> None:
        """`nbytes` of new state went into a page (counted with the blocks now)."""
        self._hold(max(self._held - nbytes, 0))

    def after(self) -> None:
        """The update is over: nothing held for it."""
        self._hold(0)
        self._before = None
