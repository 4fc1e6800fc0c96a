"""The device room that the optimizer state of blocks updated on the host
leaves to activations: `StateRoom`, one per wrapped model.

[Note: the state's room, for activations]
A block updated on the host ([Note: the optimizer step on the host] in
training/host_step.py) needs no optimizer state on the device, and its
weights change on the host at every step, so they are fetched anew after
each update wherever they were. The room its state took is worth more to
activations: a block's activations kept on the device save their bytes out
and back (on the ~1B decoder of RESULTS.md, 0.5 GB each way a block a step),
where its state kept there saves nothing once its update runs on the host,
and its update moves 8 bytes a parameter a step where a kept state moves
none (0.47 GB a block there). So under `optimizer_step="auto"` on CUDA, with
activations counted (not "keep"):

- The room activations may stay in (`Room.spare_bytes`, [Note: activations,
  the automatic choice] in training/activations.py) does not count the state
  of blocks whose last update ran on the host (`state_bytes`).
- At `step()`, when the last training pass's activations would not all stay
  in that room, and the state still on the device of blocks that may update
  on the host would make room for some (`trades`), those blocks update on
  the host: they leave at `step()`, their state going down once, as under
  "host". Where every activation stays with the state on the device (a model
  that fits trains asleep), or where the budget is so small that the state's
  room would go to blocks anyway (their weights and gradients alone exceed
  it), nothing changes.
- While it trades, such a block leaves as its backward ends in the step's
  last backward pass (as many passes as the last step had: an accumulation's
  earlier micro-batches keep it), so that its gradients go down while the
  backward runs and `step()` finds its pages on the host, as at a budget
  where blocks stream. Until `step()` gives its update, prefetch does not
  bring it back for the next forward (its weights would be the old ones,
  and its gradients would come back up). At a budget that holds every block, nothing else
  would make them leave before `step()`, and their gradients would then all
  go down after the backward, ahead of the first updates.

The blocks "auto" gives the device when the host falls behind ([Note: how
many update on the host]) bring their state in with their fetch, as at a
budget where blocks stream.
"""

from __future__ import annotations


class StateRoom:
    """Which blocks' state is in host memory because their update ran there,
    the room it leaves, and whether their state leaves the device for
    activations (see the Note).

    Args:
        pager: the model's `Pager`.
    """

    def __init__(self, pager):
        self.pager = pager
        self.on_host: dict = {}  # block -> its state's bytes, for blocks whose last update ran on the host
        self.state_bytes = 0     # ... their sum: room activations may take
        self.trading = False     # the last step sent the state of blocks down for activations
        self.awaiting: set = set()   # blocks that left after their backward for an update not yet given
        self.backwards_per_step = 1  # backward passes between the last two steps
        self._backwards_then = 0     # ended backward passes at the last step

    def step_starts(self) -> None:
        """At `step()` (once a step, whatever the number of optimizers): the
        number of backward passes since the last step."""
        passes = self.pager.hooks.backward_passes
        if passes != self._backwards_then:
            self.backwards_per_step = passes - self._backwards_then
            self._backwards_then = passes

    def trades(self, able: list) -> bool:
        """Whether the state of `able` blocks (those whose update may run on
        the host this step) leaves the device for activations (see the Note)."""
        self.trading = self._trades(able)
        return self.trading

    def _trades(self, able: list) -> bool:
        pager = self.pager
        activations = pager.activations
        if activations is None or not link_between(pager) or pager.host_steps.mode != "auto":
            return False
        spare = pager.engine.room.spare_bytes(pager) + self.state_bytes
        wanted = activations.last_pass_bytes()
        if wanted is None or wanted <= spare:
            return False  # every activation stays as it is (or none was measured yet)
        more = sum(b.segments["state"].nbytes for b in able
                   if b not in self.on_host and "state" in b.segments and b.segments["state"].resident)
        return spare + more > 0

    def placed(self, blocks: list, host_ids: set) -> None:
        """The update of each of `blocks` runs on the host this step if its
        id is in `host_ids`, else on the device."""
        for block in blocks:
            self.awaiting.discard(block)
            if id(block) in host_ids and "state" in block.segments:
                if block not in self.on_host:
                    nbytes = block.segments["state"].nbytes
                    self.on_host[block] = nbytes
                    self.state_bytes += nbytes
            elif block in self.on_host:
                self.state_bytes -= self.on_host.pop(block)

    def leaves_after_backward(self, block) -> bool:
        """Whether `block`, its backward use just ended, leaves now (see the
        Note): it updates on the host, the state trades, and this is the
        step's last backward pass."""
        if not self.trading or block not in self.on_host:
            return False
        return self.pager.hooks.backward_passes + 1 - self._backwards_then >= self.backwards_per_step

    def left_after_backward(self, block) -> None:
        """`block` left after its backward: until `step()` gives its update,
        its pages in host memory are not yet those of its next use, and
        prefetch leaves it (model/prefetch.py)."""
        self.awaiting.add(block)


def link_between(pager) -> bool:
    """Whether a link separates `pager`'s device from host memory: the trade
    is in its bytes (on the CPU device there is none)."""
    return pager.transport.is_cuda
