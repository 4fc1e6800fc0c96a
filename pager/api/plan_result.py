"""What `pager.plan` returns: `Plan`, its figures and their summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base.budget import format_bytes
from ..training.saved_bytes import SavedBytes


@dataclass
class Plan:
    """What `pager.wrap(model, budget)` will do, worked out from sizes alone.

    Bytes per forward and per training step are for the steady state of a
    model run in the same order every step (the first forward moves every
    block once). Training figures count the parameters that require grad,
    their gradients and the optimizer state it keeps on the device (from
    `optimizer`, else `state_factor` x the weights).

    [Note: a plan without inputs]
    A training step needs its blocks (the remainder and the largest block with
    their gradients and optimizer state: `train_blocks_min_bytes`) and the
    activations its forward saves, which only a forward on the step's inputs
    tells (a Hugging Face model's loss, computed inside from `labels`, saves
    its share too). Without `inputs` the plan has the first alone: a lower
    bound, which a run refuses on its first forward. So it names no least
    budget that trains (`train_min_budget_bytes` is None), `trains` is None
    (not known) unless the budget is below what the blocks need (False), and
    the text says activations are not counted. With `inputs` both are the
    run's own figures: a run whose forward is called with the same inputs
    refuses a budget below `train_min_budget_bytes` and holds it
    (tests/test_budget_first_step.py).
    """

    device: str
    budget_bytes: int
    min_budget_bytes: int
    remainder_bytes: int
    blocks: list[tuple[str, int]]
    kept: list[str]
    forward_bytes: int
    train_kept: list[str]
    train_h2d_bytes: int
    train_d2h_bytes: int
    # What a training step's blocks need at least: the remainder and the largest block with their
    # gradients and optimizer state, activations not counted (a lower bound of the budget that trains).
    train_blocks_min_bytes: int
    # The least budget that trains with the defaults, activations included: the figure a run with the
    # same inputs refuses below. None without `inputs` (activations not measured: not known).
    train_min_budget_bytes: int | None
    link_gbps: float
    link_measured: bool
    notes: list[str] = field(default_factory=list)
    # With `inputs` (see `plan`): what a training forward saves, per block,
    # and per `activations=` policy the most that activations, and blocks and
    # activations together, hold on the device in a training step.
    saved: SavedBytes | None = None
    training_peaks: dict = field(default_factory=dict)  # policy -> (activation bytes, blocks + activations)
    train_budgets: dict = field(default_factory=dict)  # policy -> the least budget that trains with it
    # Under budget_covers="process": what the process holds outside pager at a step's peak, predicted
    # from `inputs` ([Note: what sits outside pager, predicted] in training/dry_run.py); in train_budgets.
    outside_bytes: int = 0
    # Without `optimizer`: the optimizer state counted is this many times the weights (`state_factor`), an
    # estimate; a run's optimizer may keep more (Adam's `step` tensors beside each parameter).
    state_estimated_factor: float | None = None
    # With `host_budget` (`pager.load`'s disk tier): what host memory keeps,
    # and what a forward reads from disk ([Note: a kept set in host memory]).
    host_budget_bytes: int | None = None
    host_kept: list[str] = field(default_factory=list)
    forward_disk_bytes: int = 0
    disk_gbps: float | None = None
    # With `split_fetch`: the device's own link, which write-backs take (`link_gbps` is the fetches' rate),
    # and the streamed blocks the helpers keep in their memory, which a forward moves over the peer
    # links at `peer_gbps` ([Note: pages kept on helpers] in engine/helper_pages.py).
    writeback_gbps: float | None = None
    helper_kept: list[str] = field(default_factory=list)
    forward_helper_bytes: int = 0
    peer_gbps: float | None = None

    @property
    def fits_all(self) -> bool:
        return self.remainder_bytes + sum(n for _b, n in self.blocks) <= self.budget_bytes

    @property
    def runs(self) -> bool:
        return self.budget_bytes >= self.min_budget_bytes

    @property
    def activations_measured(self) -> bool:
        """The plan measured what a training forward saves (it was given `inputs`)."""
        return self.saved is not None

    @property
    def trains(self) -> bool | None:
        """The budget holds a training step with the defaults: the remainder
        and the largest block with their gradients and optimizer state, and
        the activations "auto" holds at least. False where the budget is
        below what the blocks alone need; None where it is not, but the plan
        measured no activations (no `inputs`): not known."""
        if self.budget_bytes < self.train_blocks_min_bytes:
            return False
        if self.train_min_budget_bytes is None:
            return None
        return self.budget_bytes >= self.train_min_budget_bytes

    @property
    def forward_floor_seconds(self) -> float:
        peers = self.peer_gbps
        over_peers = self.forward_helper_bytes / (peers * 1e9) if self.forward_helper_bytes and peers else 0.0
        return self.forward_bytes / (self.link_gbps * 1e9) + over_peers

    @property
    def train_floor_seconds(self) -> float:
        writeback_gbps = self.writeback_gbps or self.link_gbps
        return max(self.train_h2d_bytes / self.link_gbps, self.train_d2h_bytes / writeback_gbps) / 1e9

    def __str__(self) -> str:
        total = sum(n for _b, n in self.blocks)
        link = f"{self.link_gbps:.1f} GB/s {'measured' if self.link_measured else 'assumed'}"
        out = [
            f"pager plan on {self.device}: budget {format_bytes(self.budget_bytes)}; {len(self.blocks)} blocks "
            f"({format_bytes(total)}) + resident remainder {format_bytes(self.remainder_bytes)}; least budget "
            f"that runs {format_bytes(self.min_budget_bytes, up=True)}",
        ]
        blocks = format_bytes(self.train_blocks_min_bytes)
        if self.train_min_budget_bytes is not None:
            acts = self.train_min_budget_bytes - self.train_blocks_min_bytes - self.outside_bytes
            o = self.outside_bytes
            outside = f", + what the process holds outside pager (predicted), {format_bytes(o)}" if o else ""
            out.append(
                f"  least budget that trains {format_bytes(self.train_min_budget_bytes, up=True)}: the remainder "
                f"and the largest block with their gradients and optimizer state, {blocks}, + the activations the "
                f"defaults hold at least with these inputs, {format_bytes(acts)}{outside}"
            )
        else:  # [Note: a plan without inputs]
            out.append(
                f"  training needs {blocks} before activations: the remainder and the largest block with their "
                f"gradients and optimizer state; ACTIVATIONS NOT COUNTED, so this is a lower bound, not a budget "
                f"that trains (give the forward's inputs, labels too where the model computes its loss: "
                f"inputs= or --inputs)"
            )
        if self.state_estimated_factor is not None:
            out.append(
                f"  optimizer state ESTIMATED at {self.state_estimated_factor:g}x the weights (Adam's two "
                f"moments): pass the optimizer (optimizer= or --optimizer) for what yours keeps, such as Adam's `step` "
                f"tensors; a run with more refuses below the larger figure"
            )
        if not self.runs:
            out.append(
                f"  WILL NOT RUN: the budget is below {format_bytes(self.min_budget_bytes)} "
                "(the remainder and the largest block)"
            )
        elif self.trains is False:
            least = self.train_min_budget_bytes
            what = format_bytes(least) if least is not None else f"the {blocks} blocks need before activations"
            out.append(f"  WILL NOT TRAIN: the budget is below {what} (inference runs)")
        elif self.fits_all:
            out.append("  everything fits: no paging needed; after the first forward nothing moves")
        out.append(f"  {'block':<40} {'size':>11}  inference")
        kept, on_helpers = set(self.kept), set(self.helper_kept)
        for name, n in self.blocks:
            where = "stays resident" if name in kept else "kept on a helper" if name in on_helpers else "streams"
            out.append(f"  {name[-40:]:<40} {format_bytes(n):>11}  {where}")
        peers = (
            f" and {format_bytes(self.forward_helper_bytes)} from the helpers' memory at {self.peer_gbps:.0f} GB/s"
            if self.forward_helper_bytes
            else ""
        )
        out.append(
            f"  per forward: {format_bytes(self.forward_bytes)} to the device over PCIe{peers}, floor "
            f"{1e3 * self.forward_floor_seconds:.1f} ms at {link}"
        )
        out.append(
            f"  per training step (estimate, Adam-like state): {format_bytes(self.train_h2d_bytes)} in, "
            f"{format_bytes(self.train_d2h_bytes)} out, floor {1e3 * self.train_floor_seconds:.1f} ms; "
            f"{len(self.train_kept)} of {len(self.blocks)} blocks stay with their gradients and state"
        )
        if self.saved is not None:
            sb = self.saved
            out.append(
                f"  a training forward with these inputs saves {format_bytes(sb.total)} for its backward "
                f"(the largest block {format_bytes(max(sb.saved, default=0))}, outside blocks "
                f"{format_bytes(sb.outside)}); a training step holds at most:"
            )
            for policy, (acts, together) in self.training_peaks.items():
                excess = together + self.outside_bytes - self.budget_bytes  # (beside what sits outside pager)
                over = "" if excess <= 0 else f", {format_bytes(excess)} over"
                bound = " (the budget bounds blocks only)" if policy == "keep" else ""
                least = self.train_budgets.get(policy)
                trains = f"; trains from a budget of {format_bytes(least)}" if least is not None else ""
                out.append(
                    f"    activations={policy + ':':<11} {format_bytes(together)}: activations "
                    f"{format_bytes(acts)} + blocks {format_bytes(together - acts)}{bound}{over}{trains}"
                )
            if self.outside_bytes:
                out.append(
                    f"    outside pager (the inputs, the output, the loss's backward; predicted): "
                    f"{format_bytes(self.outside_bytes)}, in each least budget above"
                )
            out.append("    (beside: a block's temporaries while it runs, gradients between blocks)")
        if self.host_budget_bytes is not None:
            floor = (
                f", disk floor {1e3 * self.forward_disk_bytes / (self.disk_gbps * 1e9):.0f} ms at "
                f"{self.disk_gbps:.2f} GB/s"
                if self.disk_gbps
                else " (give disk_gbps= for the disk floor)"
            )
            out.append(
                f"  host budget {format_bytes(self.host_budget_bytes)}: host memory keeps {len(self.host_kept)} "
                f"blocks; per forward at most {format_bytes(self.forward_disk_bytes)} from disk{floor}"
            )
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)
