"""Optimizer state that pages with its block, and a step streamed per block.

[Note: the streamed step]
`attach(opt)` adds a step pre-hook and post-hook to the user's optimizer (its
own hook API; the optimizer object, its param_groups and state keys are never
replaced). The pre-hook runs the real update one block at a time: it brings a
block's weights, gradients and state in (prefetching the next block's), narrows
every param group to that block's parameters, calls the optimizer's undecorated
`step`, and releases the block. Parameters the pager does not manage are left
in the groups, so the user's own `step()` call that follows updates exactly
those; the post-hook restores the groups. torch.optim's updates are
per-parameter, so the result equals one full step bit for bit. Blocks with no
gradient (inactive NAS candidates, frozen blocks) are neither fetched nor
stepped, as in a full step where their grads are None.

State tensors the optimizer creates lazily on the device (Adam's exp_avg, ...)
are adopted after the block's first update: copied into the block's `state`
segment, and the dict entries in `opt.state[p]` are replaced by views of it.
What the update holds beside the pages meanwhile (that state, an unfused
optimizer's temporaries) is held out of the room: [Note: the step's room]
in training/step_room.py.
Host-side scalars (Adam's `step` on the CPU) stay where they are.

[Note: deferred updates]
A block whose gradients are paged out when `step()` is called is not brought
in for its update then. The update is recorded (the block's share of each param
group, the groups' options such as `lr` as they are now, which gradients it
reads and any scaling `clip_grad_norm_` recorded on them) and applied when the
block is next acquired, normally by the next forward: the prefetch brings its
gradients and state in with its weights, so the update's transfers overlap
the compute of the blocks before it instead of forming a transfer-only phase
after the backward, and its weights cross the link once less per step. A NAS
candidate that is not sampled next keeps its update until it is. The values
equal an immediate step's bit for bit: the same gradients, scaled as before
the step, the same options; zeroing or scaling recorded after the step
applies after the update. Whatever reads weights, gradients or state from
outside the blocks' use applies pending updates first: model and optimizer
`state_dict()` / `load_state_dict()`, `Pager.clip_grad_norm_`, `unwrap`, and
`Pager.apply_deferred()`. `wrap(..., defer_step=False)` steps every block at
once instead.

[Note: a step inside a step]
An optimizer subclass's step may call a hooked step again (its
`super().step()`, hooked once the parent class has an instance): its hooks
(ours) run again inside the first call. Inside a step pager runs itself
(`OptimizerLink._stepping`), or inside the user's own call (the frame that
called the pre-hook is still on the stack), the inner hooks do nothing: the
inner body is the outer step's. A user's step that raised leaves its call
open (no post-hook): the next step puts the groups back first.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from types import FrameType

import torch

from ..base.block import Block
from ..base.budget import allocator_counter
from ..base.common import STEP
from . import masters
from .adoption import adopt_state, device_state, fresh_state_bytes
from .grads import PagedOutGrad, replay
from .host_jobs import host_job
from .optim_state import StateDictHooks
from .shadow import shadow_of
from .step_room import StepRoom


@dataclass
class Deferred:
    """One block's update, taken at `step()`, applied at its next use."""

    link: OptimizerLink
    shares: list  # the block's parameters in each param group
    options: list  # each group's options (lr, betas, ...) at step time
    grads: set  # slots of the grads segment whose gradients the update reads
    scales: dict  # slot -> zeroing/scaling recorded on that gradient before the step


class OptimizerLink:
    """The pager's hold on one attached optimizer."""

    def __init__(self, pager, optimizer: torch.optim.Optimizer):
        self.pager = pager
        self.optimizer = optimizer
        self._saved_params: list | None = None
        self._stepping = False  # inside the optimizer's own step, called by pager
        # The frame of the user's step() call in progress ([Note: a step inside a step]).
        self._call: FrameType | None = None
        self._in_place: list = []  # blocks the user's own step() updates ([Note: a step asleep])
        self.stateless: set = set()  # id of each block whose update made no state (SGD without momentum)
        self.step_room = StepRoom(pager, optimizer, allocator_counter(pager.device), self.stateless)
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]
        self.raw_step = raw_step_of(optimizer)
        self.state_dicts = StateDictHooks(pager, optimizer)  # what state_dict() and load_state_dict() see
        self._handles += self.state_dicts.handles

    def detach(self) -> None:
        """Give the optimizer its state back as ordinary tensors on the parameters' devices."""
        if self.pager.owners is not None:
            self.pager.owners.give_whole_state(self.optimizer)  # (a collective: every rank unwraps)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.state_dicts.give_back()
        self.pager.optimizers.remove(self)

    # --------------------------------------------------------------- step
    def _pre_step(self, optimizer, args, kwargs):
        if self._stepping:
            return  # ([Note: a step inside a step])
        caller = sys._getframe(1)
        if self._call is not None:
            if _calls_inside(caller, self._call):
                return
            self._end_step(optimizer)  # the last call raised inside the optimizer's own step
        # The hook's args are the call's positional arguments, the optimizer first.
        if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
            raise ValueError(
                "pager: optimizer.step(closure) is not supported on a paged model (the closure would "
                "re-run forward inside the streamed step); call step() without a closure."
            )
        with self.pager.lock:
            try:
                self._stream_step(optimizer)
            except BaseException:
                # The user's step() raises without calling post-hooks: the
                # groups must not stay narrowed.
                self._end_step(optimizer)
                raise
        self._call = caller

    def _stream_step(self, optimizer) -> None:
        pager = self.pager
        groups = optimizer.param_groups
        self._saved_params = [g["params"] for g in groups]
        self._in_place = []  # (a user's step that raised never reached the post-hook)
        self._step_row_tables(optimizer)
        blocks = self._blocks_to_step()
        if pager.owners is not None:
            blocks = pager.owners.take_step(blocks)  # (the others' blocks: [Note: block owners])
        if self._can_step_in_place(blocks):
            self._in_place = blocks
            if not pager.row_params and not pager.expert_params:
                self._saved_params = None  # the groups stay as they are
            for g, params in zip(groups, self._saved_params or ()):
                g["params"] = [p for p in params if id(p) not in pager.row_params and id(p) not in pager.expert_params]
            return
        # Each block's share of each group, in the group's order (one pass).
        shares: dict[int, list[list]] = {id(b): [[] for _ in groups] for b in blocks}
        mine = pager.owners.mine_param if pager.owners is not None else None  # (a kept block's: by parameter)
        for gi, params in enumerate(self._saved_params):
            for p in params:
                owner = pager.param_blocks.get(id(p))
                if owner is not None and id(owner) in shares and (mine is None or mine(p)):
                    shares[id(owner)][gi].append(p)
        now, options = [], None
        factors: dict = {}
        after: list = []
        host = pager.host_steps.blocks_for(self, blocks)
        for block in blocks:
            if id(block) in host or self._can_defer(block):
                if options is None:  # the groups' options as they are now, once per step
                    options = [{k: _snapshot(v) for k, v in g.items() if k != "params"} for g in groups]
                if id(block) in host:
                    pager.host_steps.submit(block, host_job(self, block, shares[id(block)], options, factors, after))
                else:
                    self._defer(block, shares[id(block)], options)
            else:
                now.append(block)
        pager.scheduler.expect([(b, STEP) for b in now])
        try:
            # Every page on the device: nothing to bring in beside the steps,
            # so the blocks that have their state step as one.
            together = [b for b in now if not b.deps and "state" in b.segments] if pager.all_resident else []
            ids = {id(b) for b in together}
            for run in self._runs(together, shares) + [[b] for b in now if id(b) not in ids]:
                self._step_blocks(optimizer, run, shares)
            if pager.owners is not None:
                pager.owners.after_step()  # (the kept blocks' updates reach the others: [Note: block owners])
            if not pager.defer_step:
                pager.host_steps.wait_all()  # (every update done within step(), wherever it ran)
        finally:
            for g, params in zip(groups, self._saved_params):
                g["params"] = [p for p in params if not pager.managed(p)]

    def _runs(self, blocks: list[Block], shares: dict) -> list[list[Block]]:
        """`blocks` (every page on the device, pinned while they step) in
        runs whose temporaries together fit beside them ([Note: the step's
        room]): as few calls of the optimizer as the budget allows."""
        pager = self.pager
        free = pager.engine.room.room_bytes() + (pager.activation_reserve_bytes() or 0) - pager.engine.resident_bytes
        runs: list[list[Block]] = []
        held = free  # (a block alone always runs)
        for block in blocks:
            nbytes = self.step_room.temporaries([block], shares)
            if held + nbytes > free:
                runs.append([])
                held = 0
            runs[-1].append(block)
            held += nbytes
        return runs

    def _step_blocks(self, optimizer, blocks: list[Block], shares: dict) -> None:
        """Step `blocks` in one call of the optimizer: one block, or several
        with every page on the device, whose foreach kernels then launch once
        rather than once per block (a resident model's step would otherwise
        pay the host's cost per block), with the same values, as the update of
        each parameter depends on that parameter's tensors only."""
        pager = self.pager
        acquired = []
        room = self.step_room
        # What the update holds beside the pages (its temporaries, the state it
        # creates) is held out of the room first: blocks leave for it as for a
        # fetch, before anything changes ([Note: the step's room]).
        room.before(blocks, shares)
        try:
            for block in blocks:
                pager.uses.acquire(block, STEP)
                acquired.append(block)
            if pager.step_bytes:  # (blocks resident already asked for no room at their acquire)
                pager.engine.room.make_room(0, protect=set(blocks))
            pager.prefetch()
            for gi, g in enumerate(optimizer.param_groups):
                g["params"] = [p for b in blocks for p in shares[id(b)][gi]]
            room.measure(blocks)
            if pager.master_weights:
                masters.device_update(self.raw_step, optimizer, optimizer.param_groups)
            else:
                self._step_once(optimizer)
            fresh = [fresh_state_bytes(optimizer, pager, b) for b in blocks]
            room.ran(blocks, shares, sum(fresh))
            for block, nbytes in zip(blocks, fresh):
                if not adopt_state(self, block):  # (staged: let go of already)
                    room.adopted(nbytes)
                block.mark_dirty(("weights", "state"))
                if "state" not in block.segments:
                    self.stateless.add(id(block))
            if pager.owners is not None:
                pager.owners.updated_on_device(blocks)  # (the node's page gets the update now)
        finally:
            room.after()
            for block in acquired:
                pager.uses.release(block)

    def _step_row_tables(self, optimizer) -> None:
        """Update the rows each row table's gradient touches ([Note: exact
        updates of touched rows] in rows/table.py), and the experts each
        trained experts parameter's gradient covers ([Note: experts trained
        one by one] in experts/train.py)."""
        tables, experts = self.pager.row_params, self.pager.expert_params
        if not tables and not experts:
            return
        for gi, params in enumerate(self._saved_params or ()):
            for p in params:
                if p.grad is None:
                    continue
                table = tables.get(id(p))
                if table is not None:
                    table.step(optimizer, gi, self._step_once)
                elif id(p) in experts:
                    owner, index = experts[id(p)]
                    owner.step(index, optimizer, gi, self._step_once)

    # [Note: a step asleep]
    # While the pager sleeps every page is on the device and nothing leaves
    # without waking it first ([Note: asleep] in model/asleep.py), so a step of
    # blocks whose state has its page already (or that have none) needs no
    # acquire, no fetch and no narrowing of the groups: the user's own
    # `step()` call updates them with the parameters pager does not manage,
    # in one call of the optimizer, as on the unwrapped model. Afterwards,
    # state entries the optimizer replaced go back into their page, and state
    # that appeared for the first time (momentum turned on) is adopted with
    # its block pinned, as after a streamed step. Nothing is marked dirty:
    # waking marks every block so before any can leave.
    def _can_step_in_place(self, blocks: list[Block]) -> bool:
        pager = self.pager
        return (
            pager.asleep
            and not pager.master_weights  # (the user's own step would update the bf16 weights)
            and pager.owners is None  # (the others' blocks leave at a step)
            and not pager.shared_mode  # (other threads: a use pins what it touches)
            and all(("state" in b.segments or id(b) in self.stateless) and not b.deferred_steps for b in blocks)
        )

    def _after_step_in_place(self) -> None:
        pager = self.pager
        blocks, self._in_place = self._in_place, []
        with pager.lock:
            for block in blocks:
                if "state" not in block.segments:
                    if not device_state(self.optimizer, pager, block):
                        continue
                    pager.uses.acquire(block, STEP)
                    try:
                        adopt_state(self, block)
                    finally:
                        pager.uses.release(block)
                    self.stateless.discard(id(block))
                else:
                    adopt_state(self, block)

    def _post_step(self, optimizer, args, kwargs):
        if self._stepping or (self._call is not None and sys._getframe(1) is not self._call):
            return  # ([Note: a step inside a step])
        self._end_step(optimizer)

    def _end_step(self, optimizer) -> None:
        self._call = None
        if self._saved_params is not None:
            for g, params in zip(optimizer.param_groups, self._saved_params):
                g["params"] = params
            self._saved_params = None
        if self._in_place:
            self._after_step_in_place()

    def _step_once(self, optimizer) -> None:
        self._stepping = True
        try:
            if self.raw_step is not None:
                self.raw_step(optimizer)  # the step without its hooks: they run once, around the user's call
            else:
                optimizer.step()
        finally:
            self._stepping = False

    def _can_defer(self, block: Block) -> bool:
        owners = self.pager.owners
        if not self.pager.defer_step or "state" not in block.segments or (owners and owners.owns(block)):
            return False  # no state yet (its first step adopts it), or other ranks wait for its update
        return self.gradients_on_host(block)

    def group_params(self) -> list[list]:
        """Each param group's parameters as the user holds them (a step in
        progress narrows the groups themselves)."""
        if self._saved_params is not None:
            return self._saved_params
        return [g["params"] for g in self.optimizer.param_groups]

    def gradients_on_host(self, block: Block) -> bool:
        """Its gradients are in its host page (paged out, or None), and the
        update reads them there: no GradScaler scale handed to a fused step."""
        seg = block.segments.get("grads")
        if seg is None or seg.resident:
            return False  # gradients on the device: step now
        if getattr(self.optimizer, "grad_scale", None) is not None:
            return False  # GradScaler hands fused optimizers a scale that step() reads
        return all(p.grad is None or (isinstance(p.grad, PagedOutGrad) and p.grad.segment is seg) for p in block.params)

    def _defer(self, block: Block, shares: list, options: list) -> None:
        # While the update is pending, the grads page is fetched and kept
        # whatever param.grad says (Pager._check_grads_present, _page_out_grads).
        seg = block.segments["grads"]
        grads = {i for i, p in enumerate(seg.params) if isinstance(p.grad, PagedOutGrad)}
        block.deferred_steps.append(
            Deferred(self, shares, options, grads, {i: list(ops) for i, ops in seg.pending.items()})
        )
        seg.pending.clear()  # what is recorded from now on applies after the update
        self.pager.counters.deferred_steps += 1
        self.pager.prefetch_frontier.reset()  # (its use now brings its gradients and state too)

    def apply(self, block: Block, d: Deferred, make_room: bool = True) -> None:
        """Run deferred update `d` of `block` (resident, compute ordered after
        its fetch): the optimizer's own step over the block's parameters, with
        the gradients and group options it had at step time; `make_room`:
        first make room for its temporaries (not while `block` leaves: room
        is being made then).

        [Note: a deferred update touches nothing the user holds]
        It may run on any thread (the one whose access needs the block), while
        the thread that stepped calls zero_grad(), a scheduler or step() again.
        So the optimizer's step runs on a shadow of it (its own param groups,
        with this block's parameters and the step-time options; the same state
        dict), never narrowing the user's groups; and the parameters' `.grad`,
        set to the step-time gradients for the step, is only set under the
        pager's lock, which a `.grad =` on a guarded parameter takes too
        (`guards.handle`)."""
        pager = self.pager
        seg = block.segments["grads"]
        params = [p for share in d.shares for p in share]
        saved_grads = [p.grad for p in params]
        room, shares = self.step_room, {id(block): d.shares}
        temporaries = room.temporaries([block], shares)
        if make_room and temporaries:
            # Inside a use, beside its activations: room for its temporaries on
            # top of theirs, made now ([Note: the step's room]; its state has its
            # page: a first update is never deferred). They are let go when the
            # update's kernels are queued, before anything else asks for room.
            pager.engine.room.make_room(temporaries, protect={block})
        room.measure([block])
        try:
            with torch.inference_mode(False), torch.no_grad(), torch.autocast(pager.device.type, enabled=False):
                for i, ops in d.scales.items():
                    replay(seg.tensors[i], ops)
                for p in params:
                    i = pager.grad_slots.get(id(p), (None, None))[1]
                    p.grad = seg.tensors[i] if i in d.grads else None
                self._step_shadow(d)
            room.ran([block], shares, 0, hold=False)
        finally:
            for p, grad in zip(params, saved_grads):
                p.grad = grad
        adopt_state(self, block)
        block.mark_dirty(("weights", "state"))

    def _step_shadow(self, d: Deferred) -> None:
        optimizer = self.optimizer
        if self.raw_step is None:  # not a torch.optim.Optimizer: its groups are narrowed for the call
            groups = optimizer.param_groups
            saved = [(g["params"], {k: g[k] for k in options if k in g}) for g, options in zip(groups, d.options)]
            try:
                for g, share, options in zip(groups, d.shares, d.options):
                    g["params"] = share
                    g.update(options)
                optimizer.step()
            finally:
                for g, (share, options) in zip(groups, saved):
                    g["params"] = share
                    g.update(options)
            return
        groups = [
            {**g, **options, "params": share} for g, share, options in zip(optimizer.param_groups, d.shares, d.options)
        ]
        if self.pager.master_weights:
            masters.device_update(self.raw_step, optimizer, groups)
        else:
            self.raw_step(shadow_of(optimizer, groups))

    def _blocks_to_step(self) -> list[Block]:
        """Blocks with a gradient: resident ones first, then in next-forward order."""
        pager = self.pager
        in_opt = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        wanted = []
        for block in pager.all_blocks():
            if any(id(p) in in_opt and p.grad is not None for p in block.params):
                wanted.append(block)
        resident = pager.engine.resident  # (an ordered set: read once, not rebuilt per block)
        return [b for b in wanted if b in resident] + [b for b in wanted if b not in resident]


def raw_step_of(optimizer):
    """The optimizer class's step without torch.optim's decoration (its
    hooks, grad mode), or None where it has none."""
    return getattr(getattr(type(optimizer), "step", None), "__wrapped__", None)


def _calls_inside(frame, outer) -> bool:
    """Whether `frame` runs inside the call whose frame is `outer`."""
    while frame is not None:
        if frame is outer:
            return True
        frame = frame.f_back
    return False


def _snapshot(value):
    # An option that is a tensor (a tensor lr) may be changed in place by a
    # scheduler before the update runs.
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
