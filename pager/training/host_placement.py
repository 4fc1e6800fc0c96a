"""Where a step's updates run under "auto" on CUDA: `Placement`, one per
wrapped model (its `HostSteps.placement`). The host takes a block's update
where its pages are (training/host_step.py); the device takes it where the
host would keep the next forward waiting. Measured, not estimated: the
forward's length (CUDA events around it), its waits for the host, the
host's seconds per byte of an update.

[Note: how many update on the host]
Under "auto" the host takes as many of a step's blocks as it keeps up with:
when the last forward's fetches waited for updates on the host longer than
`WAIT_SHARE` of that forward's length (CUDA events around it), one block
more updates on the device from the next step on; when they waited less
than a quarter of that, one block fewer. The blocks given to the device are
the last of the forward (their deferred update rides on their fetch, late
in the forward, where the link has room), so the host reaches the first
blocks sooner. What counts is whether a forward waited, not an estimate of
the host's work: its rate varies with whatever else reads host memory, and
the backward's tail hides a part of it. Under block owners a forward also
waits for other ranks' updates on the host, and those waits count too
([Note: block owners]).

[Note: a clip holds the host's updates back]
A clip's coefficient is known on the device once the whole backward is
done, and every update that reads it waits for it to land (the factor's
copy is in the job's `after`): the head start the host has without a clip
(the last blocks updated during the backward's tail) is gone, every update
starts at the step, and where the host's update of a block takes longer
than the forward's use of one, each block of the forward waits a little
more than the one before (a 1B decoder at 40%, H200, at 03c4764: a host
update 18 ms, a block's forward 15 ms, 110-150 ms of waits a step, the step
at 1.14x the step without clip). So under a step whose gradients carry a
factor from the device (`scaled_at_step`: a clip's coefficient, or
GradScaler's `unscale_` of a device scale), the placement is a schedule,
not a count: in forward order, a block updates on the host if the host,
starting at the step and taking each block's measured time
(`seconds_per_byte` of its weights, a running mean of the updates' own
seconds), finishes it a block's time before the forward reaches it (the
forward's own length over the blocks); else on the device, where its
update rides on its fetch. The first blocks go to the device, the rest to
the host. Until both times are measured the count below decides.

The forward's own length is measured only where nothing else is in it:
a forward that waited for the host (its length less its waits: the device
may have run on while the host waited, so that is its own length at
least) or that carried updates given to the device (its copies: at most)
only bounds it. Taken as it is, either would move the next choice the way
that undoes it: one step gives every block to the host, the next forward
waits, its length less the waits is short, the next step gives ten
blocks to the device, the forward after carries their state and is long,
and every block goes to the host again (a 1B decoder at 40%, H200 at
613b5a3: steps of 0.68 and 0.82 s in turn). A forward that carried
updates and did not wait also measures what one of them adds
(`device_update_seconds`, a running mean), and the schedule weighs it:
a block the host would finish late goes to the host anyway where its
wait is shorter than that (the forward reaches every later block later by
what it waited or carried so far).

A block given to the device is on trial for one forward: its state now
crosses the link both ways, and where the link was already busy, or the
host's AdamW shares host memory with those copies, the forward grows
though the host has less to do. If that forward is longer than the one
before by more than `SLOWER_SHARE`, the block goes back to the host and
the count stays below it for `HOLD_STEPS` steps (on an H100 of a 16-core
host, 1B decoder at 40%, the count had climbed to 6 while the forwards
still waited for the host, the step at 1.3x-1.45x against 1.02x with none
given).
"""

from __future__ import annotations

import torch

WAIT_SHARE = 0.02  # a forward may wait this share of its length for updates on the host
SLOWER_SHARE = 0.02  # a forward this much longer after one more update went to the device takes it back
HOLD_STEPS = 32  # ... and for this many steps no more go to the device than before that one


class Placement:
    """How many of a step's blocks, and under a clip which, update on the
    device rather than on the host (see the Notes).

    Args:
        pager: the model's `Pager` (its blocks: a block's place in the forward).

    Example (inside pager; `HostSteps` asks at each `opt.step()`):
        >>> placement.forward_starts(measure=True)  # ... the forward ...
        >>> placement.forward_ends()
        >>> host = placement.choose(blocks)  # in the next forward's order
    """

    def __init__(self, pager):
        self.pager = pager
        self.on_device = 0  # how many of a step's blocks update on the device (the last of the forward)
        self._trial: float | None = None  # the forward's seconds before the last block given to the device (on trial)
        self._ceiling, self._ceiling_until = 0, 0  # on_device stays at most this until that many choices
        self._choices = 0
        self.waited_seconds = 0.0  # fetches' waits for updates on the host, since wrap
        self._waited_then = 0.0
        self._forward_events: tuple | None = None  # (start, end) CUDA events, reused
        self._forward_open = False
        self._forward_read = False  # the last forward's length was used by `choose`
        # Under a clip: the forward's own length on the device (neither waiting for the host nor carrying updates
        # given to the device), what one update given to the device adds to it, and how many the last step gave.
        self._forward_seconds: float | None = None
        self.device_update_seconds: float | None = None
        self._gave_device = 0
        self.seconds_per_byte: float | None = None  # the host's update time per byte of a block's weights, measured

    def figures(self) -> dict:
        """What the placement goes by, as last measured (seconds; for
        benchmarks and logs): the forward's own length, what an update given
        to the device adds to it, the host's seconds per byte of weights, how
        many blocks the device took at the last step, and the count under
        "auto" without a clip."""
        return {
            "forward_seconds": self._forward_seconds,
            "device_update_seconds": self.device_update_seconds,
            "host_seconds_per_byte": self.seconds_per_byte,
            "gave_device": self._gave_device,
            "on_device": self.on_device,
        }

    def took(self, seconds: float, weight_bytes: int) -> None:
        """An update on the host of a block of `weight_bytes` of weights took `seconds` (on the worker thread)."""
        rate = seconds / weight_bytes
        known = self.seconds_per_byte
        self.seconds_per_byte = rate if known is None else 0.75 * known + 0.25 * rate

    # ---------------------------------------------------------- choosing
    def choose(self, blocks: list) -> list:
        """Of `blocks` (in next-forward order, each able to step on the host),
        those that do: all but the last `on_device` ([Note: how many update
        on the host]), or under a clip those the host finishes in time ([Note:
        a clip holds the host's updates back])."""
        forward = None if self._forward_read else self._read_forward()
        if forward is not None:  # (once a forward: a step of several optimizers asks for each)
            self._forward_read = True
            waited, self._waited_then = self.waited_seconds - self._waited_then, self.waited_seconds
            self._measure_pace(forward, waited)
            self._gave_device = 0
            self._place(forward, waited, len(blocks))
        if self._forward_seconds is not None and self.seconds_per_byte is not None and scaled_at_step(blocks):
            host = self._by_deadline(blocks, self._forward_seconds)
        else:
            host = blocks[: len(blocks) - min(self.on_device, len(blocks))]
        self._gave_device += len(blocks) - len(host)
        return host

    def _measure_pace(self, forward: float, waited: float) -> None:
        """The forward's own length and what an update given to the device
        adds to it, from a forward of `forward` seconds that waited `waited`
        for the host ([Note: a clip holds the host's updates back])."""
        own = max(forward - waited, 0.0)
        known, carried = self._forward_seconds, self._gave_device
        waited_little = waited <= WAIT_SHARE * forward
        if known is None or (not carried and waited_little):
            pace = own
        elif not carried:  # it waited for the host: the device went on meanwhile, so its own length is at least this
            pace = max(known, own)
        else:  # it carried updates given to the device (and maybe waited): its own length is at most the whole
            pace = known
        self._forward_seconds = min(pace, forward)  # (never more than the whole: a first, cold, forward is no bound)
        if carried and waited_little:
            added = (forward - self._forward_seconds) / carried
            before = self.device_update_seconds
            self.device_update_seconds = added if before is None else 0.75 * before + 0.25 * added

    def _by_deadline(self, blocks: list, forward: float) -> list:
        """Under a clip, the blocks the host updates before the next forward
        needs them, or late by less than an update given to the device
        would make the forward ([Note: a clip holds the host's updates back])."""
        per_block = forward / max(len(self.pager.blocks), 1)
        device = self.device_update_seconds
        host, free, late = [], 0.0, 0.0
        for block in blocks:
            took = self.seconds_per_byte * block.segments["weights"].nbytes
            due = (block.index - 1) * per_block + late  # (a block's time ahead left for its fetch)
            wait = max(free + took - due, 0.0)
            if wait == 0.0 or (device is not None and wait < device):
                host.append(block)
                free += took
                late += wait
            else:
                late += device or 0.0
        return host

    def _place(self, forward: float, waited: float, n: int) -> None:
        """One more or one fewer on the device, after a forward of `forward`
        seconds that waited `waited` for the host (see the Note)."""
        self._choices += 1
        before, self._trial = self._trial, None
        if before is not None and forward > (1 + SLOWER_SHARE) * before:
            self.on_device = max(self.on_device - 1, 0)  # (the one on trial made it slower)
            self._ceiling, self._ceiling_until = self.on_device, self._choices + HOLD_STEPS
            return
        ceiling = self._ceiling if self._choices < self._ceiling_until else n
        if waited > WAIT_SHARE * forward and self.on_device < min(ceiling, n):
            self._trial = forward
            self.on_device += 1
        elif waited < WAIT_SHARE / 4 * forward:
            self.on_device = max(self.on_device - 1, 0)

    # ---------------------------------------------------------- measuring
    def forward_starts(self, measure: bool) -> None:
        """A training forward starts; `measure`: its length is measured on
        the device (CUDA events)."""
        self._forward_read = False
        if not measure:
            return
        events = self._forward_events
        if events is None:
            events = self._forward_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        self._forward_open = True

    def forward_ends(self) -> None:
        events = self._forward_events
        if self._forward_open and events is not None:
            events[1].record()
            self._forward_open = False

    def _read_forward(self) -> float | None:
        """Seconds the last training forward took on the device (None: not measured, or not done)."""
        events = self._forward_events
        if events is None or self._forward_open or not events[1].query():
            return None
        return events[0].elapsed_time(events[1]) / 1e3


def scaled_at_step(blocks: list) -> bool:
    """Whether the updates of `blocks` read a factor the device computes at
    the step (a clip's coefficient): none can start before it lands."""
    for block in blocks:
        for ops in block.segments["grads"].pending.values():
            if any(isinstance(f, torch.Tensor) and f.device.type == "cuda" for _op, f in ops):
                return True
    return False
