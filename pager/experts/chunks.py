"""A call's tokens in groups whose experts fit the cache: `token_groups`.

[Note: groups of tokens]
A call routed to more experts than the cache holds (a prefill under a
cache smaller than a layer's experts), or whose forward would copy more of
them than a share of the budget, runs its experts module on groups of its
tokens, each group's experts copied in turn ([Note: experts paged one by
one] in experts/table.py). Each token's output is its own, so a token may
join any group: the tokens go, in order, into the first group that takes
their experts within the cache (first fit), not into runs of consecutive
tokens only. Tokens routed alike then share a group wherever they are in
the call, and each expert is copied (and, trained, sends a gradient) in
fewer groups: on a skewed routing of 2048 tokens (8 of 128 experts each,
an expert's chance 1/rank), 427 copies of experts in 4 groups where runs
of consecutive tokens made 29 runs and 3156 copies (a cache of 109
experts); 3695 against 7764 at 54. A token alone is routed to fewer experts
than the cache holds (wrap sizes it so), so a group of one always runs.
"""

from __future__ import annotations

import sys

import numpy as np
import torch


def token_groups(rows, experts: int, capacity: int, most_tokens: int = sys.maxsize) -> list:
    """The tokens of each group, ascending (see the Note): every token in
    one, each group routed (`rows`: a token's experts, an integer array of
    tokens x k, or lists) to at most `capacity` of the `experts` together
    and of at most `most_tokens` tokens."""
    tokens = len(rows)
    if not tokens:
        return [[]]
    if capacity >= experts:  # (every group holds any token's experts: first fit by count alone, runs in order)
        return [list(range(start, min(start + most_tokens, tokens))) for start in range(0, tokens, most_tokens)]
    rows = np.asarray(rows, dtype=np.int64).reshape(tokens, -1)
    held = np.zeros((min(tokens, 64), experts), dtype=bool)  # (a row per group, grown as needed)
    sizes: list = []  # experts each group holds
    members: list = []  # its tokens
    for t in range(tokens):
        row = rows[t]
        count = len(sizes)
        if count:
            new = (~held[:count, row]).sum(1)
            fits = (np.asarray(sizes) + new <= capacity) & (np.fromiter(map(len, members), int, count) < most_tokens)
            g = int(fits.argmax()) if fits.any() else count
        else:
            g = 0
        if g == count:
            if count == held.shape[0]:
                held = np.concatenate([held, np.zeros_like(held)])
            sizes.append(0)
            members.append([])
        fresh = ~held[g, row]
        sizes[g] += int(np.unique(row[fresh]).size)
        held[g, row] = True
        members[g].append(t)
    return members


def gather_tokens(args, kwargs, tokens: int, index: torch.Tensor | None):
    """`args` and `kwargs` with every tensor of `tokens` rows cut to the rows `index` (all: None)."""
    if index is None:
        return args, kwargs

    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == tokens:
            return v.index_select(0, index.to(v.device, non_blocking=True))
        return v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
