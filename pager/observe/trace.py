"""A timeline of what the pager did in the last few steps, as a Chrome trace.

Spans are recorded per step into a ring of `steps` entries:

    fetch[<block>]      on the h2d stream: the copy of a block's segments in
    writeback[<block>]  on the d2h stream: the copy of its dirty segments out
    compute[<block>]    on the compute stream: from the block's use to its release
    wait[<block>]       on the compute stream: compute waiting for a fetch

On CUDA the ends of each span are timing events, resolved only when the trace
is written (no host sync while recording); on the CPU device they are host
clock readings. Load the file in chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import json
import time
from collections import deque

import torch

STREAMS = {"fetch": "h2d stream", "writeback": "d2h stream", "compute": "compute stream", "wait": "compute stream"}


class Tracer:
    """Off unless started: recording costs two CUDA events per block use."""

    def __init__(self, cuda: bool, steps: int = 0):
        self.cuda = cuda
        self.start(steps)

    def start(self, steps: int) -> None:
        self.enabled = steps > 0
        self.steps: deque = deque(maxlen=max(steps, 1))
        self.steps.append([])

    def new_step(self) -> None:
        if self.enabled:
            self.steps.append([])

    def stamp(self, stream=None):
        """A point in time on `stream` (CUDA) or on the host clock (CPU)."""
        if not self.enabled:
            return None
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream) if stream is not None else event.record()
        return event

    def span(self, kind: str, block: str, start, end, nbytes: int = 0) -> None:
        if self.enabled and start is not None and end is not None:
            self.steps[-1].append((kind, block, start, end, nbytes))

    def spans(self) -> list:
        return [s for step in self.steps for s in step]

    def write(self, path: str) -> int:
        """Write the recorded spans as Chrome trace JSON; return the event count."""
        spans = self.spans()
        events = []
        if spans:
            if self.cuda:
                torch.cuda.synchronize()
                base = spans[0][2]
                to_us = lambda e: base.elapsed_time(e) * 1e3  # noqa: E731
            else:
                base = min(s[2] for s in spans)
                to_us = lambda t: (t - base) * 1e6  # noqa: E731
            tids = {name: i for i, name in enumerate(dict.fromkeys(STREAMS.values()))}
            for kind, block, start, end, nbytes in spans:
                t0, t1 = to_us(start), to_us(end)
                if kind == "wait" and t1 <= t0:
                    continue  # the fetch had landed before compute got there
                args = {"bytes": nbytes} if nbytes else {}
                if nbytes and t1 > t0:
                    args["GB/s"] = round(nbytes / ((t1 - t0) * 1e3), 2)
                events.append(
                    {
                        "name": f"{kind}[{block}]",
                        "cat": kind,
                        "ph": "X",
                        "pid": 0,
                        "tid": tids[STREAMS[kind]],
                        "ts": t0,
                        "dur": max(t1 - t0, 0.0),
                        "args": args,
                    }
                )
            events += [
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": name}}
                for name, i in tids.items()
            ]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return len(events)
