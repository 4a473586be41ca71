"""The results of ``bench_peers.py`` as a markdown table of times and ratios, and a chart.

    python benchmarks/plot_peers.py results.json --md out.md --png out.png

Ratios are ours / peer (below 1: we are faster), each from the one run that measured both.
Needs matplotlib for the chart (a development-only dependency).
"""

from __future__ import annotations

import argparse
import json


def ms(x):
    return "—" if x is None else f"{x * 1e3:.3f}"


def mib(x):
    return "—" if x is None else f"{x / 2**20:.0f}"


def shape_text(shape):
    return " ".join(f"{k}{v}" for k, v in shape.items())


def table(result) -> str:
    v = result["versions"]
    lines = [
        "# Our kernels beside the hand-written peers",
        "",
        f"device: {v.get('device')}; date: {result['date']}; mlx {v.get('mlx')}, torch "
        f"{v.get('torch')}, triton {v.get('triton')}, fla {v.get('fla')}, accelerated-scan "
        f"{v.get('accelerated_scan')}",
        f"copy bandwidth (1 GiB x + 1, read + write): MLX {result['copy_bandwidth_mlx'] / 1e9:.0f} GB/s, "
        f"PyTorch {result['copy_bandwidth_torch'] / 1e9:.0f} GB/s",
        "",
        "Times in ms (median of 5 batches of back-to-back calls), peak memory of forward+backward "
        "in MiB (inputs included). `err` is the relative difference of the forward output from "
        "ours (sequential schedule) on the same inputs.",
        "",
        "| case | dtype | implementation | fwd | fwd+bwd | peak | err | run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        case = f"{row['spec']} {shape_text(row['shape'])}"
        for impl, r in row["runs"].items():
            run = row.get("run", "")
            if "error" in r:
                lines.append(f"| {case} | {row['dtype']} | {impl} | refused: {r['error']} | | | | {run} |")
                continue
            fb = ms(r.get("fwdbwd")) if "bwd_error" not in r else f"refused: {r['bwd_error']}"
            err = r.get("err_vs_ours", r.get("err_vs_sequential"))
            lines.append(f"| {case} | {row['dtype']} | {impl} | {ms(r.get('fwd'))} | {fb} | "
                         f"{mib(r.get('peak'))} | {'' if err is None else f'{err:.1e}'} | {run} |")
    lines += ["", "## Ratios: ours / peer (below 1: ours is faster or smaller)", "",
              "One row per schedule of ours and peer measured in the same run.", "",
              "| case | dtype | ours | peer | fwd | fwd+bwd | peak |",
              "|---|---|---|---|---|---|---|"]

    def ratio(mine, r, key):
        if not mine or "error" in mine or not r.get(key) or not mine.get(key):
            return "—"
        return f"{mine[key] / r[key]:.2f}"

    for row in result["rows"]:
        runs = row["runs"]
        ours = {k: v for k, v in runs.items() if k.startswith("ours") and k != "ours-loop"}
        for impl, r in runs.items():
            if impl.startswith("ours") or "error" in r:
                continue
            for mine_name, mine in ours.items():
                cells = [ratio(mine, r, k) for k in ("fwd", "fwdbwd", "peak")]
                lines.append(f"| {row['spec']} {shape_text(row['shape'])} | {row['dtype']} | "
                             f"{mine_name[5:]} | {impl} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chart(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["dtype"] == "float32"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.9 * len(rows) + 2.5))
    for ax, key, title in ((axes[0], "fwd", "forward"), (axes[1], "fwdbwd", "forward + backward")):
        labels, values, colors = [], [], []
        for row in rows:
            for impl, r in row["runs"].items():
                if r.get(key) is None or impl == "ours-loop":
                    continue
                labels.append(f"{row['spec']} {shape_text(row['shape'])}\n{impl}")
                values.append(r[key] * 1e3)
                colors.append("tab:blue" if impl == "ours-chunked" else
                              "tab:cyan" if impl.startswith("ours") else "tab:gray")
        ax.barh(range(len(values)), values, color=colors)
        ax.set_yticks(range(len(values)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_title(f"{title}, fp32")
    fig.suptitle(f"{result['versions'].get('device')}, {result['date']} — blue: ours, chunked; "
                 "cyan: ours, sequential; gray: peers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--md", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    text = table(result)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.png:
        chart(result, args.png)


if __name__ == "__main__":
    main()
