"""`--plot PATH` of the sweeping benches (copy, hash, ipc): one PNG of lines, one per series, over the swept axis.

matplotlib is imported only when a plot is asked for (a bench without `--plot` never pays for it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def lines(path: str, series: Mapping[str, Sequence[tuple[float, float]]], *, title: str, xlabel: str, ylabel: str,
          logx: bool = False, logy: bool = False) -> None:
    """Write `series` ({label: [(x, y), ...]}) as one line each to the PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        xs, ys = zip(*sorted(points)) if points else ((), ())
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
