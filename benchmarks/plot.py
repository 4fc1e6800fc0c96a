"""Draw the budget sweep (sweep.json), the training sweep (train_sweep.json)
and a pager trace (trace.json) as PNGs.

    python -m benchmarks.plot sweep.json budget.png
    python -m benchmarks.plot --train train_sweep.json train_budget.png
    python -m benchmarks.plot --trace trace.json timeline.png ["title"]
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


def plot_train_sweep(path: str, png: str) -> None:
    """Step time (against all on GPU) and allocator peak against the budget,
    per activations policy and optimizer placement, with the peers as lines."""
    d = json.load(open(path))
    series, lines = {}, []
    for row in d["rows"]:
        extra = row.get("extra") or {}
        if "share" in extra:
            label = (f"activations {extra['activations']}, optimizer_step={extra['placement']}" if "activations" in extra
                     else row["method"].split("), ", 1)[1])
            series.setdefault(label, []).append((100 * extra["share"], row["ratio"], row["peak_gib"]))
        elif row["ms"] is not None:
            lines.append((row["method"].split(" (")[0], row["ratio"], row["peak_gib"]))
    fig, (ax_time, ax_peak) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in series.items():
        points.sort()
        ax_time.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax_peak.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=label)
    for (label, ratio, peak), style in zip(lines, ("-", ":", "-.", "--")):
        ax_time.axhline(ratio, color="grey", ls=style, lw=1.2, label=f"{label} ({ratio:.2f}x)")
        ax_peak.axhline(peak, color="grey", ls=style, lw=1.2, label=f"{label} ({peak:.1f} GiB)")
    ax_time.set_ylabel("step time / all on GPU")
    ax_peak.set_ylabel("allocator peak (GiB)")
    for ax in (ax_time, ax_peak):
        ax.set_xlabel("budget (% of weights + gradients + AdamW state)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{d['rows'][0]['workload']} — {d['env']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot_trace(path: str, png: str, title: str | None = None) -> None:
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
    ax.set_title(title or "pager timeline: fetches on the h2d stream overlap compute (budget of 2 layers)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    if sys.argv[1] == "--trace":
        plot_trace(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
    elif sys.argv[1] == "--train":
        plot_train_sweep(sys.argv[2], sys.argv[3])
    else:
        plot_sweep(sys.argv[1], sys.argv[2])
