"""Draw the budget sweep (sweep.json) and a pager trace (trace.json) as PNGs.

    python -m benchmarks.plot sweep.json budget.png
    python -m benchmarks.plot --trace trace.json timeline.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_sweep(path: str, png: str) -> None:
    d = json.load(open(path))
    layer_gb = d["layer_bytes"] / 1e9
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, series in d["series"].items():
        ks, ms = zip(*series)
        ax.plot([k * layer_gb for k in ks], ms, marker="o", label=label)
    ks = [k for k, _ in next(iter(d["series"].values()))]
    floor = [(d["layers"] - k) * d["layer_bytes"] / (d["pinned_h2d_GBps"] * 1e9) * 1e3 for k in ks]
    ax.plot([k * layer_gb for k in ks], floor, "k--", label="PCIe floor (bytes that must move)")
    ax.axhline(d["all_on_gpu_ms"], color="grey", lw=1, label=f"all on GPU ({d['all_on_gpu_ms']:.1f} ms)")
    for label, ms in d["lines"].items():
        if ms:
            ax.axhline(ms, ls=":", lw=1.5, label=f"{label} ({ms:.0f} ms)", color=None)
    ax.set_yscale("log")
    ax.set_xlabel("device budget for the layers (GB)")
    ax.set_ylabel("forward time (ms, log)")
    ax.set_title(f"7B-shaped bf16 decoder, {d['layers']} layers, 512 tokens — {d['env']['device']}")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot_trace(path: str, png: str) -> None:
    events = json.load(open(path))["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X"]
    colors = {"fetch": "tab:blue", "compute": "tab:green", "wait": "tab:red", "writeback": "tab:orange"}
    fig, ax = plt.subplots(figsize=(11, 2.8))
    t0 = min(e["ts"] for e in spans)
    for e in spans:
        row = e["tid"] + (0.4 if e["cat"] == "wait" else 0)
        ax.barh(row, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.35 if e["cat"] == "wait" else 0.7,
                color=colors[e["cat"]], edgecolor="white", lw=0.3)
    ax.set_yticks(list(tracks), [tracks[t] for t in tracks])
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), ncol=4, fontsize=8, loc="upper right")
    ax.set_title("pager timeline: fetches on the h2d stream overlap compute (budget of 2 layers)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    if sys.argv[1] == "--trace":
        plot_trace(sys.argv[2], sys.argv[3])
    else:
        plot_sweep(sys.argv[1], sys.argv[2])
