"""The benchmarks' plotting, shared by ``bench/collective_bench.py`` and ``bench/ps_bench.py`` (``--plot``).

matplotlib is a bench-only extra (``pip install -e '.[bench]'``; CI does not install it): it is imported
here, lazily, only when a figure is drawn, and a missing matplotlib is a ``PlotUnavailable`` whose message
says how to install it. Figures are written with the Agg backend (no display needed). A figure that was not
measured in the run that draws it (a recorded baseline) is always drawn marked as such: hatched, and its
legend entry says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

MATPLOTLIB_HINT = "pip install -e '.[bench]' (or pip install matplotlib)"


class PlotUnavailable(RuntimeError):
    """matplotlib cannot be imported, so no figure can be drawn."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; raises PlotUnavailable (naming the install) without it."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable(f"matplotlib is not installed ({e}); {MATPLOTLIB_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str) -> None:
    """Write ``fig`` to ``path`` (PNG, 100 dpi) and release it."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass(frozen=True)
class Bar:
    """One bar of a grouped bar chart: ``value`` of series ``series`` in group ``group``; ``recorded``: not
    measured in this run (drawn hatched, its legend entry says so)."""

    group: str
    series: str
    value: float
    recorded: bool = False


RECORDED_NOTE = "recorded, not this run"


def grouped_bars(path: str, bars: Sequence[Bar], *, title: str, ylabel: str) -> None:
    """A bar chart of ``bars``: one cluster per group (in first-seen order), one colour per series (in
    first-seen order, the same in every group), each bar labelled with its value. Raises PlotUnavailable."""
    plt = pyplot()
    groups = list(dict.fromkeys(b.group for b in bars))
    series = list(dict.fromkeys(b.series for b in bars))
    width = 0.8 / max(1, max(sum(1 for b in bars if b.group == g) for g in groups) if groups else 1)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.5))
    labelled: set[str] = set()
    for gi, group in enumerate(groups):
        mine = [b for b in bars if b.group == group]
        for k, b in enumerate(mine):
            x = gi + width * (k - (len(mine) - 1) / 2)  # the group's bars centred on its tick
            label = b.series + (f" ({RECORDED_NOTE})" if b.recorded else "")
            colour = colours[series.index(b.series) % len(colours)]
            rect = ax.bar(x, b.value, width * 0.95, color=colour, alpha=0.45 if b.recorded else 1.0,
                          hatch="//" if b.recorded else None, edgecolor="black" if b.recorded else colour,
                          label=None if label in labelled else label)
            labelled.add(label)
            ax.bar_label(rect, labels=[f"{b.value:,.0f}"], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=15 if len(groups) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    save(fig, path)
