"""Plots of bench/decode.py results: tokens/s vs batch size, and vs MTP draft length.

    python bench/plot_decode.py docs/data/decode-9b-tp1.json docs/data/decode-9b-tp2.json --out docs/decode.png

Files that differ only in a -bN suffix (decode-27b-tp1.json, decode-27b-tp1-b8.json) are one series.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=Path("docs/decode.png"))
    parser.add_argument("--k", type=int, default=3, help="the MTP draft length plotted against batch size")
    args = parser.parse_args()
    import matplotlib  # here, so that --help answers where matplotlib is not installed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_batch, by_k) = plt.subplots(1, 2, figsize=(14, 4.6))
    peer = False
    series: dict[str, dict] = {}  # decode-27b-tp1.json and decode-27b-tp1-b8.json: one series, 27b-tp1
    for path in args.results:
        data = json.loads(path.read_text())
        label = re.sub(r"-b\d+$", "", path.stem.removeprefix("decode-"))
        merged = series.setdefault(label, {"decode": [], "transformers": []})
        merged["decode"] += data["decode"]
        merged["transformers"] += data.get("transformers", [])
    for label, data in series.items():
        rows = sorted(data["decode"], key=lambda r: r["batch"])
        plain = [r for r in rows if r["k"] == 0]
        by_batch.plot([r["batch"] for r in plain], [r["tokens_per_s"] for r in plain], "o-", label=f"{label}, MTP off")
        for forced in sorted({r["forced"] for r in rows if r["k"] == args.k}):
            mtp = [r for r in rows if r["k"] == args.k and r["forced"] == forced]
            by_batch.plot([r["batch"] for r in mtp], [r["tokens_per_s"] for r in mtp], "s--",
                          label=f"{label}, MTP k={args.k} (forced {forced})")
        for batch in sorted({r["batch"] for r in rows}):
            for forced in sorted({r["forced"] for r in rows if r["k"]}):
                series = sorted((r for r in rows if r["batch"] == batch and r["forced"] in (None, forced)),
                                key=lambda r: r["k"])
                by_k.plot([r["k"] for r in series], [r["tokens_per_s"] for r in series],
                          "o-" if forced >= 0.8 else "o:", label=f"{label}, batch {batch}, forced {forced}")
        for hf in data.get("transformers", []):
            by_batch.plot([hf["batch"]], [hf["tokens_per_s"]], "kx", markersize=9)
            peer = True
    if peer:
        by_batch.plot([], [], "kx", label="transformers generate")
    by_batch.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s",
                 title=f"tokens/s vs batch (MTP: k = {args.k})")
    by_k.set(yscale="log", xlabel="MTP drafts per step (k; 0 = off)", ylabel="decode tokens/s",
             title="tokens/s vs k (dotted: forced 0.6)")
    by_batch.legend(fontsize=7, loc="upper left")
    by_k.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
