#!/usr/bin/env python
"""Plot one or several runs' ``--metrics-file`` JSONL as a PNG: training and validation loss, bits per byte,
learning rate, gradient norm, tokens/s and memory, against iterations or consumed tokens.

    python tools/plot_metrics.py --metrics-file ckpt/metrics.jsonl --output metrics.png
    python tools/plot_metrics.py --metrics-file a/metrics.jsonl b/metrics.jsonl --label "TP2 PP2" "DP4" \\
        --x tokens --output compare.png

Runs are overlaid, one colour each, named by --label (default: the file's directory name). A panel is
drawn only for a metric some run has (bits per byte needs a tokenizer with text; gradient norm needs
clipping or DeepSpeed's norm). Iterations a resumed run logged again (it restarted from an earlier
checkpoint) replace the earlier records of the same iteration. Drawn with matplotlib's Agg backend: no
display needed.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.config.base import arg, parse_configs  # noqa: E402
from megatron_ru.utils.jsonl import json_objects  # noqa: E402


@dataclass
class PlotConfig:
    """Plot"""

    metrics_file: list[str] = arg(default_factory=list, help="metrics.jsonl file(s) written by --metrics-file; "
                                                             "several: overlaid runs.")
    label: Optional[list[str]] = arg(None, "One name per --metrics-file (default: each file's directory name).")
    x: str = arg("iterations", "Horizontal axis: iterations, or training tokens consumed.",
                 choices=("iterations", "tokens"))
    output: str = arg("metrics.png", "PNG file to write.")
    title: Optional[str] = arg(None, "Figure title.")

    def problems(self) -> list[str]:
        out = []
        if not self.metrics_file:
            out.append("--metrics-file is required: one or more metrics.jsonl files written by pretrain_gpt.py")
        if self.label is not None and len(self.label) != len(self.metrics_file):
            out.append(f"--label needs one name per --metrics-file ({len(self.metrics_file)} files, "
                       f"{len(self.label)} labels)")
        if not self.output.lower().endswith(".png"):
            out.append(f"--output {self.output}: a .png file name is expected")
        return out


@dataclass
class Run:
    """One metrics file: its train records and its eval records by split, each sorted by iteration."""

    label: str
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def tokens_per_iteration(self) -> Optional[float]:
        """Training tokens per iteration (constant: no batch ramp-up), for records without consumed_tokens."""
        for r in self.train:
            if r.get("consumed_tokens") and r.get("iteration"):
                return r["consumed_tokens"] / r["iteration"]
        for r in self.train:  # files from before consumed_tokens: tokens/s x seconds per iteration
            if r.get("tokens_per_sec") and r.get("elapsed_ms"):
                return r["tokens_per_sec"] * r["elapsed_ms"] / 1000.0
        return None


def read_run(path: str, label: str) -> Run:
    """A run from a metrics JSONL file; later records of an iteration replace earlier ones."""
    train: dict[int, dict[str, Any]] = {}
    evals: dict[str, dict[int, dict[str, Any]]] = {}
    example = '{"type": "train", "iteration": 1, "lm_loss": ...}'
    for lineno, rec in json_objects(path, "--metrics-file", example):
        if "iteration" not in rec:
            raise ValueError(f"--metrics-file {path}, line {lineno}: not a metrics record (no 'iteration')")
        if rec.get("type") == "train":
            train[rec["iteration"]] = rec
        elif rec.get("type") == "eval":
            evals.setdefault(rec.get("split", "validation"), {})[rec["iteration"]] = rec
    if not train and not evals:
        raise ValueError(f"--metrics-file {path}: no train or eval records")
    return Run(label, [train[k] for k in sorted(train)],
               {split: [recs[k] for k in sorted(recs)] for split, recs in evals.items()})


@dataclass(frozen=True)
class Panel:
    """One subplot: ``key`` of the train records (or, with ``split_key``, of the eval records)."""

    title: str
    key: Optional[str] = None
    eval_key: Optional[str] = None
    log_y: bool = False

    def has_data(self, runs: Sequence[Run]) -> bool:
        return any(_series(run, self.key, self.eval_key) for run in runs)


PANELS = (
    Panel("loss (train: line, validation: dots)", key="lm_loss", eval_key="val_loss"),
    Panel("validation bits per byte", eval_key="val_bits_per_byte"),
    Panel("learning rate", key="lr"),
    Panel("gradient norm", key="grad_norm", log_y=True),
    Panel("tokens/s (whole job)", key="tokens_per_sec"),
    Panel("memory (MiB)", key="peak_memory_mib"),
)


def _x(run: Run, rec: dict[str, Any], axis: str) -> Optional[float]:
    if axis == "iterations":
        return rec["iteration"]
    if rec.get("consumed_tokens") is not None:
        return rec["consumed_tokens"]
    per_it = run.tokens_per_iteration()
    return None if per_it is None else rec["iteration"] * per_it


def _series(run: Run, key: Optional[str], eval_key: Optional[str], axis: str = "iterations"
            ) -> list[tuple[str, list[float], list[float]]]:
    """(kind, xs, ys) of a panel for one run: 'train', or 'eval:<split>' per validation split."""
    out = []
    sources = []
    if key:
        sources.append(("train", run.train, key))
    if eval_key:
        sources += [(f"eval:{split}", recs, eval_key) for split, recs in run.evals.items()]
    for kind, recs, k in sources:
        pts = [(_x(run, r, axis), r[k]) for r in recs if r.get(k) is not None]
        pts = [(x, y) for x, y in pts if x is not None]
        if pts:
            out.append((kind, [p[0] for p in pts], [p[1] for p in pts]))
    return out


def panels_for(runs: Sequence[Run]) -> list[Panel]:
    """The panels some run has data for, in :data:`PANELS` order."""
    return [p for p in PANELS if p.has_data(runs)]


def build_figure(runs: Sequence[Run], axis: str = "iterations", title: Optional[str] = None) -> Any:
    """The matplotlib Figure (Agg): one subplot per panel with data, every run overlaid."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("plotting needs matplotlib: pip install matplotlib (make install does)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    panels = panels_for(runs)
    if not panels:
        raise ValueError("nothing to plot: the metrics files have none of loss, bits per byte, learning rate, "
                         "gradient norm, tokens/s or memory")
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.6 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            color = colors[i % len(colors)]
            for kind, xs, ys in _series(run, panel.key, panel.eval_key, axis):
                if kind == "train":
                    ax.plot(xs, ys, color=color, linewidth=1.5, label=run.label)
                else:
                    split = kind.split(":", 1)[1]
                    name = run.label if panel.key is None else f"{run.label} ({split})"
                    ax.plot(xs, ys, color=color, linestyle="--", marker="o", markersize=4, label=name)
        ax.set_title(panel.title)
        if panel.key == "peak_memory_mib":
            labels = {r.get("memory_label") for run in runs for r in run.train if r.get("memory_label")}
            if len(labels) == 1:
                ax.set_title(f"{labels.pop()} (MiB)")
        if panel.log_y:
            ax.set_yscale("log")
        ax.set_xlabel("training tokens" if axis == "tokens" else "iteration")
        if axis == "tokens":
            ax.xaxis.set_major_formatter(EngFormatter())
        ax.grid(True, alpha=0.3)
        if len(runs) > 1 or panel.key is None or panel.eval_key is not None:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def default_label(path: str) -> str:
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return parent or os.path.splitext(os.path.basename(path))[0]


def main(argv: Optional[Sequence[str]] = None) -> str:
    from megatron_ru.config.base import validate_all
    cfg = parse_configs([PlotConfig], argv, description=__doc__.split("\n\n")[0])[PlotConfig]
    validate_all([cfg])
    labels = cfg.label or [default_label(p) for p in cfg.metrics_file]
    runs = [read_run(p, label) for p, label in zip(cfg.metrics_file, labels)]
    fig = build_figure(runs, cfg.x, cfg.title)
    out_dir = os.path.dirname(os.path.abspath(cfg.output))
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(cfg.output, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    print(f"wrote {cfg.output} ({', '.join(p.title for p in panels_for(runs))})")
    return cfg.output


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"plot_metrics.py: error: {e}", file=sys.stderr)
        sys.exit(1)
