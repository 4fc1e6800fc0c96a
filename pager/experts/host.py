"""Cold experts computed on the host: `ColdExperts`, `HostCall`.

[Note: cold experts on the host]
A decode token routes to k experts of a layer; those the device cache lacks
(cold) must otherwise cross the link before the layer can finish: a
Mixtral-8x7B-shaped expert is 352 MB, 6.4 ms at 55 GB/s, for one token's
product with it. The host holds every expert in its page already and can
run that product itself: a few rows against one expert's weights is a pass
over them in host memory, which is as fast as the link or not far from it,
and it runs *beside* the link. So of a call's cold experts, some are
copied in and the rest computed on the host at the same time; the layer
then takes about the longer of the two, not their sum (Fiddler's idea, and
ktransformers' and llama.cpp's `--n-cpu-moe` statically; here per call, by
measured cost).

How a call goes, where some of its cold experts `H` are the host's:
1. the pre-hook (experts/table.py `_bring`) routes the entries of `H` on the
   device to another expert of the call with a weight of 0 (it adds 0: the
   device's products and sums are the rest's, unchanged) or, where every
   expert of the call is the host's, gives the device's forward no tokens;
   it takes the hidden states and weights of `H`'s tokens to the host (a
   few KB a token; the host already waits for the routing there);
2. the device's forward is queued as ever: its copies and kernels run while
3. the post-hook, with the parameters on their host tensors again, computes
   each expert of `H` over its tokens in the module's dtype (`expert_product`:
   for transformers' `use_experts_implementation` convention, its
   `batched_mm` steps for one expert on views of the expert's weights, its
   own gate and flags; a module of one's own: its forward, with a routing
   of that one expert), and adds the products into the device's output
   (`index_add_`, after the device's kernels, on the compute stream).
The sum of a token's experts is then in another order than the unpaged
module's: equal within the kernels' rounding, not bit for bit. (The kept
expert an entry of the host's is routed to computes that token for
nothing; its product times 0 is 0 unless it overflows to inf, as float16
weights could, where it would make a NaN.) Only calls without gradients:
the host's products are not part of the autograd graph.

Which cold experts go to the host (`ColdExperts.choose`): each takes
`link` seconds to copy in (the copies' measured time: events around a
call's fills, read back at a later call) and `host[n]` seconds to compute
there over its `n` tokens of the call (a running mean of the host's own
products by `n`: a product of more rows costs the host more, and one mean
would mix a prompt's products with a decode's), and a call the host takes
part in costs it `overhead` more (the split, with its copies of the host
rows' hidden states and weights to the host, and the sum: ~20 small ops).
The host's time is not free, though: while the device copies, the host
queues the rest of the layer and the next one's attention, and a product
delays that. What the host has to spare is what it waits at the next
layer's routing (`.cpu()` of the router's choice: the device still busy),
measured after calls all copied, by their count of cold experts `c`
(`wait[c]`: where the host is the slower, as in a decode of small experts,
it waits for nothing, and a wait of 0 at one count says little of what it
would wait at another; an unmeasured count takes the least its measured
neighbours allow: a wait is never shorter after more cold experts, nor
longer by more than a copy for each). A call of `c` cold
experts with `k` of them the host's then ends, after the host's queuing,
at about `max(host's sum + overhead, wait[c] - k * link)`; the host takes
the cheapest first (the least used among equals: the cache's counts, the
ones it would be slowest to keep) while that is sooner; never one of more
than `HOST_MOST_TOKENS` tokens (a prefill's products are compute, the
device's). While it takes some, one call in `REMEASURE_CALLS` is all
copied, so the waits are measured again. (Counted without the host's
queuing, as the first version did, the host took one of a
Qwen3-30B-A3B-shaped layer's ~7.5 cold experts on the H200, 0.77 ms against
0.19 ms a copy, and a token took 77.7 ms against 41.8 with none.) Where a
token count's time is not known, one cold expert of that many tokens goes
there to measure it (the host's first call warms it up and is not
counted); where the host then takes none, one goes again after
`REMEASURE_CALLS` calls, then twice as many each time it still takes none
(to `REMEASURE_MOST`: a measure of a host slower than the link costs its
difference), each such measure over two calls in a row, the first not
counted (a Mixtral-shaped expert measured 33-37 ms on the H200's host when
computed that rarely, 7 ms in a row: not yet understood), so a change (an
idle host, a slower link) can be seen.
Only on CUDA (`"auto"`);
`cold_experts="host"` takes every cold expert within the tokens' bound to
the host (the CPU device too: that is how the tests run it), `"device"`
none.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch
import torch.nn as nn

COLD_EXPERTS = ("auto", "host", "device")
HOST_MOST_TOKENS = 4  # an expert computed on the host takes at most this many of a call's tokens
REMEASURE_CALLS = 64  # where the host takes no cold expert, one goes there again after this many calls
REMEASURE_MOST = 4096  # ... twice as many each time it still takes none, at most this many
MEAN_WEIGHT = 0.25  # of a new measure in the running means
WAIT_WEIGHT = 1 / 8  # of a new measure of a wait at the routing (noisier: the device's work, the host's queuing)


def eager_forward(module: nn.Module):
    """The forward that computes `module`'s experts without copying their
    weights: transformers' own under `use_experts_implementation` (the
    decorated class keeps it as `forward.__wrapped__`), else the module's."""
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


_CONVENTION = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")


def expert_product(module: nn.Module):
    """`product(expert, hidden, weights)`: one expert's weighted output for
    its tokens' `hidden` (n, hidden) and routing `weights` (n,), on the
    host. For a module of transformers' `use_experts_implementation`
    convention (its flags set), its `batched_mm` steps for one expert on
    views of its weights (no routing masks, no copy of the expert: a
    tenth of the eager forward's calls; a Qwen3-30B-A3B-shaped expert at
    one token, 0.34 against 0.47 ms on a 2-core host, its bytes' floor
    there 0.33); otherwise the module's eager forward with a routing of
    that one expert."""
    if not all(isinstance(getattr(module, flag, None), bool) for flag in _CONVENTION):
        forward = eager_forward(module)

        def eager(expert: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            one = torch.full((hidden.shape[0], 1), expert, dtype=torch.long)
            return forward(module, hidden, one, weights.unsqueeze(1))

        return eager
    m = cast(Any, module)
    first = "gate_up_proj" if m.has_gate else "up_proj"

    def linear(x: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        w = getattr(m, name)[expert]
        out = x @ w if m.is_transposed else torch.nn.functional.linear(x, w)
        return out + getattr(m, f"{name}_bias")[expert] if m.has_bias else out

    def product(expert: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = linear(hidden, first, expert)
        out = m._apply_gate(out) if m.has_gate else m.act_fn(out)
        out = linear(out, "down_proj", expert)
        if m.has_post_expert_norm:
            out = m.post_expert_norm(out)
        return out * weights.unsqueeze(-1)

    return product


def _running_mean(known: float | None, value: float, weight: float = MEAN_WEIGHT) -> float:
    return value if known is None else (1 - weight) * known + weight * value


class ColdExperts:
    """Where one cache's cold experts run, and what each side costs
    (see [Note: cold experts on the host]).

    Args:
        mode: "auto", "host" or "device" (`wrap`'s `cold_experts`).
        cuda: whether the cache is on a CUDA device ("auto" computes nothing on
            the host otherwise: the host is the device).

    Example (inside pager):
        >>> cold = ColdExperts("host", cuda=False)
        >>> cold.choose([3, 9], counts=[5, 1], tokens=[1, 1])
        [3, 9]
    """

    def __init__(self, mode: str, cuda: bool):
        self.mode, self.cuda = mode, cuda
        self._measures = mode == "auto" and cuda  # (the link's time and the host's waits: "auto" on CUDA)
        self.link_seconds: float | None = None  # to copy one expert in, measured
        # to compute one on the host, measured, by its tokens in the call (1 .. HOST_MOST_TOKENS)
        self.host_seconds: dict[int, float] = {}
        self.overhead_seconds = 0.0  # the host's own time in a call it takes part in, besides its products
        # the host's wait at the next layer's routing after a call all copied, by its cold experts ("auto")
        self.wait_seconds: dict[int, float] = {}
        self._host_calls = 0  # the host's calls so far (the first warms it up: not a measure)
        self._calls_since = 0  # calls since the host last computed an expert ("auto")
        self._remeasure_after = REMEASURE_CALLS  # calls without the host before it measures again
        self._hosted = 0  # calls in a row the host took part in by the waits ("auto")
        self._warming = self._again = False  # a measure's first call (not counted); its second to come
        self._copied: tuple | None = None  # (the call's `base`, its cold experts) of a call all copied, not yet read
        self._fill_events: tuple | None = None  # (start, end) events around a call's fills, made once
        self._timed_experts = 0  # the experts of the fills being timed (0: none)

    @property
    def on(self) -> bool:
        return self.mode == "host" or self._measures

    def choose(self, cold: list, counts: list, tokens: list, base: int = 0) -> list:
        """Which of the `cold` experts (with their use `counts` and the call's
        `tokens` of each) the host computes: see the Note. `base`: the
        calling table's first key (which layer: `routing_waited`)."""
        fit = [i for i, n in enumerate(tokens) if n <= HOST_MOST_TOKENS]
        if not fit:
            return []
        if self.mode == "host":
            return [cold[i] for i in fit]
        self._calls_since += 1
        link = self.link_seconds
        if link is None:
            return []  # (the link not timed yet)
        unknown = [i for i in fit if tokens[i] not in self.host_seconds]
        if unknown:  # (measure the host at that many tokens: one, the least used)
            return self._took([min(unknown, key=lambda i: counts[i])], cold)
        least = min(fit, key=lambda i: counts[i])
        if self._again:  # (a measure's second call)
            self._again = False
            return self._took([least], cold)
        wait = self._wait_for(len(cold), link)
        chosen: list = []
        if wait is not None and self._hosted < REMEASURE_CALLS:
            chosen = self._cheapest(fit, counts, tokens, wait, link)
        if chosen:
            self._hosted += 1
            self._remeasure_after = REMEASURE_CALLS
        elif self._calls_since >= self._remeasure_after:  # (measured again: the host or the link may have changed)
            chosen, self._warming = [least], True
            self._remeasure_after = min(2 * self._remeasure_after, REMEASURE_MOST)
        else:
            self._hosted = 0
            self._copied = (base, len(cold))  # (its wait at the next routing)
        return self._took(chosen, cold)

    def _wait_for(self, cold: int, link: float) -> float | None:
        """The host's wait at the next routing after a call of `cold` cold
        experts all copied: measured, or the least it can be by the counts
        measured around it (None where none is): a wait is never shorter
        after more cold experts, nor longer by more than a copy for each."""
        known = self.wait_seconds.get(cold)
        if known is not None:
            return known
        lower = [w if n < cold else w - (n - cold) * link for n, w in self.wait_seconds.items()]
        if not lower:
            return None
        upper = [w if n > cold else w + (cold - n) * link for n, w in self.wait_seconds.items()]
        return min(max(lower), min(upper))

    def _cheapest(self, fit: list, counts: list, tokens: list, wait: float, link: float) -> list:
        """The cheapest on the host first, the least used among equals, each
        taken while the call then ends sooner: the longer of the host's sum
        and what the device does after the host's queuing (`wait` with every
        cold expert copied, less a copy for each one the host takes)."""
        chosen: list = []
        host = 0.0
        for i in sorted(fit, key=lambda i: (self.host_seconds[tokens[i]], counts[i])):
            more = host + self.host_seconds[tokens[i]] + (0.0 if chosen else self.overhead_seconds)
            if max(more, wait - (len(chosen) + 1) * link) >= max(host, wait - len(chosen) * link):
                break
            chosen.append(i)
            host = more
        return chosen

    def routing_of(self, index: torch.Tensor, base: int) -> torch.Tensor:
        """The routing `index` of a call of the table at `base`, flat, on the
        host; its wait timed ("auto" on CUDA: `routing_waited`)."""
        if not self._measures:
            return index.reshape(-1).cpu()
        started = time.perf_counter()
        routing = index.reshape(-1).cpu()
        self.routing_waited(time.perf_counter() - started, base)
        return routing

    def routing_waited(self, seconds: float, base: int) -> None:
        """The host waited `seconds` for the routing of the table at `base`:
        where the call before, of the layer before, was all copied, the wait
        for its count of cold experts (see the Note). (A call of the first
        layer follows the last layer's of the token before and whatever the
        caller did between: not a measure.)"""
        copied, self._copied = self._copied, None
        if copied is not None and base > copied[0]:
            cold = copied[1]
            self.wait_seconds[cold] = _running_mean(self.wait_seconds.get(cold), seconds, WAIT_WEIGHT)

    def _took(self, chosen: list, cold: list) -> list:
        if chosen:
            self._calls_since = 0
        return [cold[i] for i in sorted(chosen)]

    def host_took(self, seconds: float, tokens: int) -> None:
        """The host computed an expert over `tokens` of a call in `seconds`
        (its first call is not counted: it starts the host's threads and
        picks its kernels, 5-7x a later call's time on the H200's host)."""
        if self._host_calls and not self._warming and tokens <= HOST_MOST_TOKENS:
            self.host_seconds[tokens] = _running_mean(self.host_seconds.get(tokens), seconds)

    def host_call_done(self, overhead: float) -> None:
        """A call the host took part in is done; its own time besides the
        products was `overhead` seconds (not counted in its first call, nor
        in a measure's first: its second follows)."""
        if self._warming:
            self._warming, self._again = False, True
        elif self._host_calls:
            self.overhead_seconds = _running_mean(self.overhead_seconds if self._host_calls > 1 else None, overhead)
        self._host_calls += 1

    # ----------------------------------------------------------- the link's time
    def fills_start(self, device):
        """An event recorded on `device`'s current stream before a call's
        fills where they are to be timed ("auto" on CUDA, none being timed),
        else None. (Two events made once, recorded again: nothing made per
        call.)"""
        if not self._measures or self._timed_experts:
            return None
        if self._fill_events is None:
            self._fill_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        start = self._fill_events[0]
        start.record(torch.cuda.current_stream(device))
        return start

    def fills_end(self, start, device, experts: int) -> None:
        """After the fills of `experts` cold experts begun at `start`: their
        time is read at a later call (`read_fills`), never waited for."""
        if start is None or not experts or self._fill_events is None:
            return
        self._fill_events[1].record(torch.cuda.current_stream(device))
        self._timed_experts = experts

    def read_fills(self) -> None:
        """The link's time per expert from fills timed before, once done."""
        if not self._timed_experts or self._fill_events is None:
            return
        start, end = self._fill_events
        if not end.query():
            return
        self.link_seconds = _running_mean(self.link_seconds, start.elapsed_time(end) / 1e3 / self._timed_experts)
        self._timed_experts = 0


def split_cold(cache, base: int, experts: list, inverse: torch.Tensor, index, weights, hidden):
    """The call's cold experts the host computes (see the Note), if any:
    (a `HostCall` for the post-hook, the experts left to the device, the
    routing's ranks among those (a host expert's entries: 0), the device's
    weights with those entries 0); else None. `experts` and `inverse` are
    `ExpertTable._routed`'s; `index`, `weights` and `hidden` the call's."""
    started = time.perf_counter()
    cold_of = cache.cold
    cold_of.read_fills()
    shape = index.shape
    if not isinstance(weights, torch.Tensor) or weights.shape != shape or hidden.dim() != 2 or len(shape) != 2:
        return None  # (not the convention's shapes: (tokens, hidden), (tokens, k) twice)
    if hidden.shape[0] != shape[0]:
        return None
    cold = [i for i, e in enumerate(experts) if not cache.holds(base + e)]
    if not cold:
        return None
    entries = torch.bincount(inverse, minlength=len(experts)).tolist()
    chosen = cold_of.choose(
        [experts[i] for i in cold], [cache.uses(base + experts[i]) for i in cold], [entries[i] for i in cold], base
    )
    if not chosen:
        return None
    on_host = torch.zeros(len(experts), dtype=torch.bool)
    on_host[[experts.index(e) for e in chosen]] = True
    for e in chosen:
        cache.count_use(base + e)  # (the cache's counts see every use: [Note: which experts stay])
    keep = [e for i, e in enumerate(experts) if not on_host[i]]
    ranks = torch.cumsum(~on_host, 0) - 1  # (each kept expert's rank among the kept)
    entry_host = on_host[inverse].view(shape)
    rows = torch.nonzero(entry_host.any(-1)).view(-1)  # (the tokens that route to a host expert)
    routing = torch.tensor(experts, dtype=index.dtype)[inverse].view(shape)[rows]
    routing[~entry_host[rows]] = -1  # (the device's entries: not the host's to compute)
    device_rows = rows.to(hidden.device, non_blocking=True)
    call = HostCall(
        chosen,
        routing,
        weights.detach()[device_rows].cpu(),
        hidden.detach()[device_rows].cpu(),
        rows,
        all_host=not keep,
        like=hidden,
    )
    device_weights = weights.masked_fill(entry_host.to(weights.device, non_blocking=True), 0)
    call.seconds = time.perf_counter() - started
    return call, keep, ranks.clamp(min=0)[inverse], device_weights


class HostCall:
    """One call's share of cold experts computed on the host: made at the
    pre-hook (`split_cold`), added into the device's output at the post-hook
    (`add_to`).

    Args:
        experts: the experts the host computes.
        routing: on the host, the routing of the call's tokens that route to
            one of them, (rows, k) (-1 where the entry is the device's).
        weights: on the host, their routing weights, (rows, k).
        hidden: on the host, their hidden states, (rows, hidden).
        rows: their rows in the call's output.
        all_host: every expert of the call is the host's (the device's
            forward ran on no tokens).
        like: the call's hidden states (the output's device, dtype and rows).
    """

    __slots__ = ("experts", "routing", "weights", "hidden", "rows", "all_host", "like", "seconds")

    def __init__(self, experts: list, routing, weights, hidden, rows, all_host: bool, like: torch.Tensor):
        self.experts, self.routing, self.weights, self.hidden = experts, routing, weights, hidden
        self.rows, self.all_host, self.like = rows, all_host, like
        self.seconds = 0.0  # the host's own time in the call besides its products, so far (the split's)

    def add_to(self, module: nn.Module, output: torch.Tensor, cold: ColdExperts, counters) -> torch.Tensor:
        """`output` (the device's) with the host's products added; `module`'s
        parameters are on their host tensors (and its `num_experts` its own)."""
        began = time.perf_counter()
        product_of = expert_product(module)
        rows, products = [], []
        with torch.no_grad():
            for e in self.experts:
                started = time.perf_counter()
                token, pos = torch.nonzero(self.routing == e, as_tuple=True)
                products.append(product_of(e, self.hidden[token], self.weights[token, pos]))
                rows.append(self.rows[token])
                took = time.perf_counter() - started
                cold.host_took(took, token.numel())
                self.seconds -= took
            product, row = torch.cat(products).to(output.dtype), torch.cat(rows)
            if self.all_host:  # (the device's forward ran on no tokens: its output has no rows)
                output = output.new_zeros((self.like.shape[0], *output.shape[1:]))
            if output.device.type == "cuda":
                # (page-locked by torch's caching host allocator, which keeps them until the copies are done)
                product, row = product.pin_memory(), row.pin_memory()
            output.index_add_(0, row.to(output.device, non_blocking=True), product.to(output.device, non_blocking=True))
        cold.host_call_done(self.seconds + time.perf_counter() - began)
        counters.expert_host += len(self.experts)
        return output
