"""Where a step's time goes, from a torch.profiler Chrome trace (as
`bench_train --profile-share` and `bench_dp --profile` write them): how long
each GPU stream kind was busy (compute, copies each way, NCCL), how long
compute idled, its longest gaps and what the copy engines and pager's host
ranges (`pager::...`) were doing in them.

    python -m benchmarks.profile_summary train_profile_1.0.json.gz [more traces]
"""

from __future__ import annotations

import collections
import gzip
import json
import sys

GAP_US = 500  # compute gaps shorter than this are not listed
LISTED_GAPS = 12
HOST_WORDS = ("wait", "reduce", "deferred", "evict", "fetch")  # pager's host ranges worth naming at a gap


def load(path: str) -> list:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def union(intervals) -> list:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def busy(intervals) -> float:
    return sum(end - start for start, end in intervals)


def overlap(intervals, start, end) -> float:
    return sum(max(0, min(end, b) - max(start, a)) for a, b in intervals)


def kind_of(event) -> str:
    name = event["name"]
    if event.get("cat") == "gpu_memcpy":
        return "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "d2d"
    return "nccl" if "nccl" in name.lower() else "compute"


def summarize(path: str) -> str:
    events = load(path)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return f"{path}: no GPU events"
    t0, t1 = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    by_kind = collections.defaultdict(list)
    for e in gpu:
        by_kind[kind_of(e)].append((e["ts"], e["ts"] + e["dur"]))
    streams = {k: union(v) for k, v in by_kind.items()}
    compute = streams.get("compute", [])
    lines = [f"{path}: GPU span {(t1 - t0) / 1e3:.1f} ms"]
    lines += [f"  {k:8s} busy {busy(v) / 1e3:8.1f} ms ({len(by_kind[k])} ops)" for k, v in sorted(streams.items())]
    lines.append(f"  compute idle {(t1 - t0 - busy(compute)) / 1e3:.1f} ms")
    host = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and e["name"].startswith("pager::")]
    totals, counts = collections.Counter(), collections.Counter()
    for e in host:
        key = e["name"].split("[")[0]
        totals[key] += e["dur"]
        counts[key] += 1
    lines += [f"  host {k:28s} {totals[k] / 1e3:8.1f} ms ({counts[k]})" for k in sorted(totals)]
    gaps = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(compute, compute[1:]) if b[0] - a[1] >= GAP_US),
                  reverse=True)
    copies = {k: streams.get(k, []) for k in ("h2d", "d2h", "nccl")}
    in_gaps = {k: sum(overlap(v, s, e) for _g, s, e in gaps) for k, v in copies.items()}
    lines.append(f"  compute gaps >= {GAP_US / 1e3:g} ms: {len(gaps)}, {sum(g for g, _s, _e in gaps) / 1e3:.1f} ms; "
                 + ", ".join(f"{k} busy in them {v / 1e3:.1f} ms" for k, v in in_gaps.items()))
    for g, s, e in gaps[:LISTED_GAPS]:
        inside = sorted({h["name"] for h in host if h["ts"] < e and h["ts"] + h["dur"] > s
                         and any(w in h["name"] for w in HOST_WORDS)})[:4]
        lines.append(f"    {g / 1e3:6.1f} ms at +{(s - t0) / 1e3:8.1f}: "
                     + ", ".join(f"{k} {overlap(v, s, e) / 1e3:.1f}" for k, v in copies.items())
                     + f" ms; host in {inside}")
    return "\n".join(lines)


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(summarize(trace))
