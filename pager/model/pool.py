"""A pool: one device budget that several wrapped models share (serving).

    pool = pager.Pool(budget="60GiB")
    chat = pager.wrap(chat, pool=pool, name="chat")
    rerank = pager.wrap(rerank, pool=pool, name="rerank")

The pool is a residency engine made before its models ([Note: the residency
engine] in engine/engine.py): their blocks compete for one budget, each model's
kept set is chosen in its share of the room ([Note: sharing the room]), and
requests from several threads wait for room that others hold instead of
failing ([Note: waiting for room]).
"""

from __future__ import annotations

import numbers

from ..base.budget import format_bytes, parse_budget, resolve_device
from ..base.common import ROOM_WAIT_SECONDS
from ..engine.engine import Engine
from ..engine.split_fetch import helper_budgets, resolve_helpers
from ..observe.stats import PoolStats


class Pool:
    """One device budget for several models: `pager.wrap(model, pool=pool)`.

    Blocks of all the pool's models count against its budget. A model that
    sits idle lends its room (its blocks leave first when another model
    needs room, and its share of the room shrinks as other models' requests
    fill the last `SHARE_WINDOW`); one in use keeps what its forward needs.
    Forwards of the pool's models may run from several threads at once: a
    request waits for room held by other requests in flight, up to
    `wait_seconds`, then fails with a `BudgetError` that names who holds it.
    A model leaves the pool on `pager.unwrap(model)`.

    Args:
        budget: device bytes for all the pool's models, as for `pager.wrap`
            (an int, "60GiB", "75%", "auto"). The state each model's forwards
            carry (a KV cache) and, where a model pages them, its training
            activations come out of it too.
        device: the device; defaults to the current CUDA device, else "cpu".
        pin: page-lock host pages (fast asynchronous copies).
        wait_seconds: how long a request waits for room that other requests
            hold before it fails.
        split_fetch: other GPUs whose links carry a share of every fetch of
            the pool's models, and whose memory keeps pages up to a budget
            each, as for `pager.wrap` ("all", ["cuda:1"], {"cuda:1": "20GiB"}).

    Example:
        >>> pool = pager.Pool(budget="20GiB")
        >>> pager.wrap(chat_model, pool=pool, name="chat")
        >>> pager.wrap(embedder, pool=pool, name="embed")
        >>> with torch.inference_mode():
        ...     chat_model(ids)       # from any thread; both share the 20 GiB
        >>> print(pool.report())
    """

    def __init__(
        self, budget, *, device=None, pin: bool = True, wait_seconds: float = ROOM_WAIT_SECONDS, split_fetch=None
    ):
        if isinstance(wait_seconds, bool) or not isinstance(wait_seconds, numbers.Real) or not wait_seconds > 0:
            raise ValueError(
                f"pager: Pool(wait_seconds={wait_seconds!r}) must be a number of seconds > 0 (how long "
                f"a request waits for room other requests hold)."
            )
        device = resolve_device(device)
        budget_bytes = parse_budget(budget, device)
        helpers = resolve_helpers(split_fetch, device, pin)
        helpers = list(zip(helpers, helper_budgets(split_fetch, helpers, budget_bytes)))
        self.engine: Engine = Engine(device, budget_bytes, pin=pin, wait_seconds=float(wait_seconds), helpers=helpers)
        self.engine.pool = self

    def __repr__(self) -> str:
        e = self.engine
        return (
            f"Pool({e.device}, budget {format_bytes(e.budget_bytes)}, models {list(self.models)}, "
            f"{format_bytes(e.resident_bytes)} resident)"
        )

    @property
    def device(self):
        return self.engine.device

    @property
    def budget_bytes(self) -> int:
        return self.engine.budget_bytes

    @property
    def models(self) -> dict:
        """The pool's wrapped models by name, in the order they joined."""
        return {o.name: o.model for o in self.engine.owners}

    def stats(self) -> PoolStats:
        """The pool's totals (resident and peak bytes, waits for room) and each
        model's `Stats` by name: a snapshot.

        Example:
            >>> s = pool.stats(); print(s.peak_resident_bytes <= s.budget_bytes, s.models["chat"].misses)
        """
        e = self.engine
        with e.lock:
            models = {o.name: o.stats() for o in e.owners}
            return PoolStats(
                budget_bytes=e.budget_bytes,
                resident_bytes=e.resident_bytes,
                peak_resident_bytes=e.peak_resident_bytes,
                carried_bytes=sum(o.carried_bytes for o in e.owners),
                h2d_bytes=sum(s.h2d_bytes for s in models.values()),
                d2h_bytes=sum(s.d2h_bytes for s in models.values()),
                waits=e.waiters.waits,
                waited_seconds=e.waiters.waited_seconds,
                timeouts=e.waiters.timeouts,
                models=models,
            )

    def report(self) -> str:
        """`stats()` as text: the pool's line, then one line per model.

        Example:
            >>> print(pool.report())
        """
        s = self.stats()
        return "\n".join([str(s)] + [f"  {name}: {st}" for name, st in s.models.items()])

    def reset(self) -> None:
        """Zero every model's counters and the pool's (peaks restart from now)."""
        e = self.engine
        with e.lock:
            for o in e.owners:
                o.reset()
            e.peak_resident_bytes = e.resident_bytes
            w = e.waiters
            w.waits, w.waited_seconds, w.timeouts = 0, 0.0, 0

    def set_budget(self, budget) -> None:
        """Change the pool's budget; blocks leave until the new one holds.

        Args:
            budget: as for `Pool` (bytes, "10GiB", "60%", "auto").

        Example:
            >>> pool.set_budget("30GiB")
        """
        e = self.engine
        nbytes = parse_budget(budget, e.device)
        with e.lock:
            least = e.least_budget()
            if nbytes < least:
                raise ValueError(
                    f"pager: Pool budget={budget!r} ({format_bytes(nbytes)}) is below the {format_bytes(least)} its "
                    f"models need together (what each holds for life, and room for the largest block); give at "
                    f"least that, or unwrap a model first."
                )
            e.set_budget(nbytes)
