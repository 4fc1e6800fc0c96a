"""Where a budget holds every block's weights and gradients but not its
activations beside the blocks' optimizer state, the state goes to host memory
and the updates run there: `StateRoom`, one per wrapped model.

[Note: the state off the device]
Under `optimizer_step="auto"` a block whose state is on the device updates
there ([Note: the optimizer step on the host] in training/host_step.py). At
a budget that holds every block with its state, that kept the state of every
block on the device and sent every activation out: the 1B decoder of
RESULTS.md at 100% held 15.6 GiB of its 15.7 (17.1 GiB in the allocator,
above torchao's 16.2) for a step of 1.05x-1.07x all on the GPU: the GPU ran
every block's AdamW, and the forward waited for its copies out. With the
state in host memory the same budget runs as one where blocks stream: each
block's update on the host during the backward's tail and the next forward,
its weights up and gradients down (8 bytes a parameter a step), the
activations out and back as before. Measured on an H100 (16-core host), 100%
then steps at 1.00x-1.01x with 13.2 GiB in the allocator, 60% at 1.00x-1.01x
against 1.10x. So under "auto" on CUDA, with activations counted (not
"keep"):

- At `step()`, when the last training pass's activations would not all stay
  in the room the budget has beyond every block with all its pages
  (`Room.spare_bytes`), and without the state of the blocks that may update
  on the host (those of earlier steps' host updates, `state_bytes`, and
  those still on the device) the budget would hold every block's weights
  and gradients beside what else it reserves, those blocks update on the host:
  they leave at `step()`, their state going down once, as under "host".
  Where every activation stays beside every block's state (a model that fits
  trains asleep), or where blocks stream anyway, nothing changes. Nor does it
  for a block with frozen parameters (LoRA's base weights): leaving, it would
  take them along, and they would come back at its next use unchanged.
- While it trades, such a block leaves as its backward ends in the step's
  last backward pass (as many passes as the last step had: an accumulation's
  earlier micro-batches keep it), so that its gradients go down while the
  backward runs and `step()` finds its pages on the host, as at a budget
  where blocks stream; at a budget that holds every block nothing else would
  make them leave before `step()`, and their gradients would then all go
  down after the backward, ahead of the first updates. Until `step()` gives
  its update, prefetch does not bring it back for the next forward (its
  weights would be the old ones, and its gradients would come back up).

The blocks "auto" gives the device when the host falls behind ([Note: how
many update on the host]) bring their state in with their fetch, as at a
budget where blocks stream.

Tried and measured first: the state's room counted as room for activations
to stay in ([Note: activations, the automatic choice] in
training/activations.py). On the 1B decoder at 100% "auto" then kept 8-9
blocks' activations and recomputed the rest (a pass that offloaded them
broke the budget): 1.11x-1.13x, slower than offloading all (1.05x), as the
weights and gradients of every block now crossed the link as well.
"""

from __future__ import annotations


class StateRoom:
    """Which blocks' state is in host memory because their update ran there,
    and whether the state of those that may update there leaves the device
    (see the Note).

    Args:
        pager: the model's `Pager`.
    """

    def __init__(self, pager):
        self.pager = pager
        self.on_host: dict = {}  # block -> its state's bytes, for blocks whose last update ran on the host
        self.state_bytes = 0  # ... their sum
        self.trading = False  # the last step sent the state of blocks down (see the Note)
        self.awaiting: set = set()  # blocks that left after their backward for an update not yet given
        self.backwards_per_step = 1  # backward passes between the last two steps
        self._backwards_then = 0  # ended backward passes at the last step

    def step_starts(self) -> None:
        """At `step()` (once a step, whatever the number of optimizers): the
        number of backward passes since the last step."""
        passes = self.pager.hooks.backward_passes
        if passes != self._backwards_then:
            self.backwards_per_step = passes - self._backwards_then
            self._backwards_then = passes

    def traded(self, able: list) -> list:
        """Those of `able` blocks (whose update may run on the host this step)
        whose state leaves the device now (see the Note): none, or every one
        that may trade."""
        able = [b for b in able if tradable(b)]
        self.trading = self._trades(able)
        return able if self.trading else []

    def _trades(self, able: list) -> bool:
        pager = self.pager
        activations = pager.activations
        if not able or activations is None or not link_between(pager) or pager.host_steps.mode != "auto":
            return False
        spare = pager.engine.room.spare_bytes(pager)  # (every block with all its pages)
        wanted = activations.last_pass_bytes()
        if wanted is None or wanted <= spare:
            return False  # every activation stays beside the state (or none was measured yet)
        more = sum(
            b.segments["state"].nbytes
            for b in able
            if b not in self.on_host and "state" in b.segments and b.segments["state"].resident
        )
        # (else blocks stream anyway: their weights and gradients, and the activations the
        # budget holds beside them, do not fit)
        return spare + self.state_bytes + more - activations.ledger.reserve() > 0

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

    def backward_ended(self, block) -> None:
        """`block`'s backward use has ended: it leaves now if it updates on
        the host while the state trades and this is the step's last backward
        pass, and prefetch leaves it until `step()` gives its update (its
        pages in host memory are not yet those of its next use; see the Note)."""
        if block.pins or not self.trading or block not in self.on_host or not tradable(block):
            return
        if self.pager.hooks.backward_passes + 1 - self._backwards_then < self.backwards_per_step:
            return  # (an accumulation's earlier backward: it stays for the next)
        engine = self.pager.engine
        if block in engine.resident and not block.resident_for_life and engine.evict(block):
            self.awaiting.add(block)
            self.pager.prefetch_frontier.reset()  # (a walk waits at it: [Note: the prefetch frontier])


def tradable(block) -> bool:
    """Whether `block` may leave for its update (see the Note): one with
    frozen parameters (LoRA's base weights) would leave them too, to be
    fetched again at its next use though they did not change."""
    return "frozen" not in block.segments


def link_between(pager) -> bool:
    """Whether a link separates `pager`'s device from host memory: the trade
    is in its bytes (on the CPU device there is none)."""
    return pager.transport.is_cuda
