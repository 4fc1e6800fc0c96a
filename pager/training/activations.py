"""What a block's forward saves for its backward: counted, kept, sent to host memory, or dropped and recomputed.

A block's forward that builds a graph may run under pager's saved-tensor
hooks (`base/saving.py`): each tensor autograd saves goes to the policy of
this module that the use passed in, which decides what the graph holds
instead.

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

[Note: the faster policy, predicted]
Offloading moves what a block saved over the host link twice (out in the
forward, back in the backward: on the link the blocks' pages stream on);
recomputing runs the forward of the blocks again. Which costs less depends
on what bounds the pass: a pass bound by compute hides the copies under it
(the 1B decoder trained in float32, 4x1024 tokens: there offloading was the
fastest of the three wherever it held), a pass bound by the link hides the
recomputation (LoRA on a 7B-shaped Llama, 4x512 tokens: the frozen pages
stream twice a step, and offloading moved half again as many bytes, 1.45x
the link's floor). So "auto" predicts each policy's pass
(`SavedBytes.predicted_seconds`): the link carries the weights of the pages
that do not fit beside the activations the policy holds twice (in for the
forward, in for the backward; their gradients and optimizer state stay where
the host updates them) and what it sends; compute runs the forward's FLOPs,
counted on the fake tensors by torch's flop counter, the backward's (as many
again for each of an op's two operands that needs a gradient: once for a
frozen weight's matmul) and the recomputation's; a pass takes the longer of
the two, at the link's rate as measured (`Pager.link_gbps`) or seen in the
pager's copies (else 55 GB/s, PCIe Gen5's, assumed: the first pass, before
any copy) and a 2048-square matmul's, measured once a process in the dtype
most of the FLOPs run in (its 48 MiB at most freed at once; the link is not
probed). The policies are taken in the order of those seconds, the first
that the budget holds chosen. It is an estimate: what an inner block's
refetch for its outer block's recomputation costs (where the room does not
hold the layer) is not in it. On the CPU device the copies are not beside
compute, and the order of [Note: activations, the automatic choice] stands.

[Note: blocks inside a recomputed block]
A block whose forward runs inside a recomputed block's (a decoder
layer's linears, blocks of their own where the budget is small) is
recomputed with it: what it saves is dropped for the outer block's
recomputation, which runs it again ([Note: saves counted across nested
blocks] in training/recompute.py), so only the outer block's inputs are
kept, not each inner block's (a frozen linear's input is the very
activation it saves). In the backward the outer block's recomputation
fetches its inner blocks, which its backward then finds on the device.
An inner block that keeps its own ("auto"'s tail) keeps them.
"""

from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_flatten

from ..base import saving
from ..base.budget import format_bytes
from ..base.common import BudgetError
from .ledger import Ledger
from .offload import ActivationOffload
from .recompute import Recompute
from .refusals import least_budget, plan_refusal, unmeasured_refusal
from .saved_bytes import (
    KEEP,
    OFFLOAD,
    OFFLOAD_VIEWS_KEPT,  # offload, but saved views that are not contiguous stay (stats say "offload")
    RECOMPUTE,
    SavedBytes,
    choose,
    fastest_first,
)

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
    training/saved_bytes.py): offload with saved views that are not contiguous
    (attention's transposed q, k and v) staying on the device, which moves
    the fewest bytes; offload of every dense save; recompute, which holds
    least and costs a forward again. On a CUDA device they are taken in the
    order of their predicted seconds instead ([Note: the faster policy,
    predicted]). A budget that none holds is refused at that first forward,
    before it runs, with the least budget that holds: a `BudgetError`. The reserve, what
    blocks leave to activations, is the prediction from the first pass on,
    or the most the last pass held where that was more. Values are the same under every
    policy (bit for bit on the CPU device).
    A forward that cannot run on fake tensors (it reads values) runs its
    first pass under recompute (it holds least), the reserve growing as it
    goes, and "auto" keeps recompute for the blocks that do not keep theirs;
    before each training forward and at an optimizer's first step, the least
    that blocks need beside what the last pass held (nothing before the
    first) is still checked, and a budget that does not hold it refused.
    What a pass holds beside its activations that pager bounds (paged
    experts' copies of a call with gradients: experts/table.py) counts with
    the activations, in the plan and in the reserve. Where the budget does
    not hold a step, pager's caches that hold more than they need (the
    experts' caches, sized at wrap for inference) give room back before
    anything is refused (`give_back`).
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
            reserved (`Room.spare_bytes`) and what a pass holds beside its
            activations (`beside_bytes`).
        least_bytes: the least that blocks (with their gradients and optimizer
            state) and what pager keeps beside them need in a training step.
        measure: `(args, kwargs) -> (SavedBytes, blocks)`: the root forward's
            saves per block, on fake tensors, and the `Block` of each name;
            raises `ValueError` where the forward cannot run on them.
        outside_bytes: what the process holds outside pager, learned
            (`budget_covers="process"`), for the refusal's figures.
        budget_total: the budget as given (the refusal names budgets so).
        beside_bytes: `(budget=None) -> bytes`: what a training pass holds on
            the device beside its activations under `budget` (None: the
            budget as given), a share of it bounded by pager (paged experts'
            copies of a call with gradients); held out of blocks' room with
            the activations.
        give_back: `nbytes -> freed`: device memory pager holds beyond the
            least it runs in, given up for a step the budget would not hold
            otherwise (the experts' caches shrink); returns what it freed.
        update_bytes: the most an update of one block on the device holds
            beyond the least that blocks need, at the step, where
            activations hold nothing ([Note: the step's room] in
            training/step_room.py): the budget holds the larger of the two.
        least_said: a clause for a refusal on what the least that blocks
            need holds that the user can change ("" where nothing).
        speeds: `SavedBytes -> Speeds | None`: what the device does in a
            second, for "auto"'s choice ([Note: the faster policy,
            predicted]); None: the policies' own order.
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
        beside_bytes=lambda budget=None: 0,
        give_back=lambda nbytes: 0,
        update_bytes=lambda: 0,
        least_said=lambda: "",
        speeds=lambda planned: None,
    ):
        self.stats, self.transport, self.budget_bytes, self.spare_bytes = stats, transport, budget_bytes, spare_bytes
        self.least_bytes, self.measure, self.outside_bytes = least_bytes, measure, outside_bytes
        self.budget_total, self.beside_bytes, self.give_back = budget_total, beside_bytes, give_back
        self.update_bytes, self.least_said, self.speeds = update_bytes, least_said, speeds
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
        self._planned_for: tuple | None = None  # `_plan_key()` when it was chosen
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
            self._check_unmeasured(at_step=False)
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
                self._check_unmeasured(at_step=False)
                return
            self._planned_dims = _widest(shapes, self._planned_dims)
        elif self._plan_key() == self._planned_for:
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
        if self._planned_dims is None:
            self._check_unmeasured(at_step=True)
        elif self.planned is None or self._planned_for is None:
            return  # (no forward planned yet: the first one counts the state)
        elif self._plan_key() != self._planned_for:
            self._decide(self.planned, self._planned_blocks, at_step=True)

    def _plan_key(self) -> tuple:
        """What a plan was made for: the least blocks need, the budget, an update's room."""
        return self._least(), self.budget_bytes(), self.update_bytes()

    def _least(self) -> int:
        """What blocks and what pager keeps beside them need at least in a
        training step, and what the pass holds beside its activations."""
        return self.least_bytes() + self.beside_bytes()

    def _decide(self, planned: SavedBytes, blocks: list, at_step: bool = False) -> None:
        """Choose the kept blocks and the policy of the others from `planned`
        and check that the budget holds them; nothing changes if it does not
        (`at_step`: asked at an optimizer's first step, not at a forward)."""
        kw = {"min_bytes": self.offload.min_bytes, "copies": self.transport.is_cuda}
        chosen, budget, least = self._choose(planned, kw)
        if chosen is None and budget is not None:
            short = least + max(min(self._held(planned, kw).values()), self.update_bytes()) - budget
            if short > 0 and self.give_back(short):  # (then the budget may hold the step)
                chosen, budget, least = self._choose(planned, kw)
        if chosen is None:
            raise self._refusal(planned, budget, least, kw, at_step)
        self.ledger.beside = self.beside_bytes()
        kept, policy, held = chosen
        by_name = {b.name: b for b in blocks}
        self._planned_for = (least, budget, self.update_bytes())
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

    def _choose(self, planned: SavedBytes, kw) -> tuple:
        """(the choice of `choose`, or None where the budget holds none; the budget; the least blocks need)."""
        budget, least = self.budget_bytes(), self._least()
        room = None if budget is None else budget - least  # what activations may hold beside blocks
        if room is not None and self.update_bytes() > room:
            return None, budget, least  # (the step's update alone does not fit beside the blocks)
        policy, speeds = (AUTO, self.speeds(planned)) if self.asked == AUTO else (self.policy, None)
        spare = self.spare_bytes()
        chosen = choose(planned, policy, spare, room, speeds, **kw)
        if speeds is not None and chosen is not None:
            log.info(
                "pager: a training pass predicted at %s (%.0f GB/s in, %.1f TFLOP/s in %s)",
                ", ".join(
                    f"{1e3 * t:.1f} ms under {p}" for p, _h, t in fastest_first(planned, chosen[0], spare, speeds, kw)
                ),
                speeds.link_bytes_per_s / 1e9,
                speeds.flops_per_s / 1e12,
                planned.flops_dtype,
            )
        return chosen, budget, least

    @staticmethod
    def _held(planned: SavedBytes, kw) -> dict:
        """What activations hold at most under each policy (none kept)."""
        return {p: planned.peak(p, (), **kw) for p in (OFFLOAD_VIEWS_KEPT, OFFLOAD, RECOMPUTE)}

    def _least_budget(self, need: int) -> int:
        return least_budget(need, self.beside_bytes)

    def _check_unmeasured(self, at_step: bool) -> None:
        """Where the forward could not be measured on fake tensors: the
        least that blocks need beside what activations held in the last pass
        (none before the first) must fit the budget, or the step is refused
        (before it changes anything)."""
        budget = self.budget_bytes()
        if self.measure is None or budget is None:
            return
        acts, least = max(self.ledger.last_pass_peak, self.update_bytes()), self._least()  # (at the step: the update's)
        if least + acts > budget and self.give_back(least + acts - budget):
            budget, least = self.budget_bytes(), self._least()
        self.ledger.beside = self.beside_bytes()
        if least + acts > budget:
            out = self.budget_total() - budget
            need = self._least_budget(out + least + acts)
            raise unmeasured_refusal(least, acts, budget, out, at_step, need, self.least_said())

    def _refusal(self, planned: SavedBytes, budget: int, least: int, kw, at_step: bool) -> BudgetError:
        held = self._held(planned, kw)
        mine = held[self.policy] if self.asked != AUTO else min(held.values())
        if self.asked == AUTO:  # (either way of offloading)
            held[OFFLOAD] = min(held[OFFLOAD], held[OFFLOAD_VIEWS_KEPT])
        del held[OFFLOAD_VIEWS_KEPT]
        out = self.outside_bytes()
        staging = self.budget_total() - budget - out
        return plan_refusal(
            held,
            mine,
            self.asked,
            least,
            budget,
            out,
            staging,
            at_step,
            self._least_budget,
            self.update_bytes(),
            self.least_said(),
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
        enclosing = saving.active_recompute()
        if enclosing is not None:  # ([Note: blocks inside a recomputed block])
            return None, enclosing
        if self.policy == RECOMPUTE:
            return None, Recompute(block, args, kwargs, self.stats, self.ledger)
        return self.offload, None

    def backward_reaches(self, block) -> None:
        self.offload.backward_reaches(block)


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
