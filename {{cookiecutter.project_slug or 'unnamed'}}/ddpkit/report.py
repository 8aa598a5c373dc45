"""Curves and tables of runs, for a terminal over SSH as much as for a laptop.

    python report.py runs/a runs/b ...           # overlay the runs, print a comparison table
    python report.py runs/a --out runs/report    # where the PNG and the tables go

Each run is read from its own files: train_log.jsonl (a line per logged window of steps),
metrics.jsonl (a line per epoch) and summary.json (the task's headline metric, whether higher
is better, how the run ended). A training run calls `plot_runs` for itself at its end
(run_end.py: <run>/curves.png); a sweep's summary (extras/sweep/summary.py) uses `rank`,
`markdown_table` and `write_table`.
"""

import argparse
import csv
import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"
LINE_STYLES = ("-", "--", ":", "-.")  # a run's parameter groups in the learning-rate panel


@dataclass
class RunHistory:
    path: Path
    windows: list[dict] = field(default_factory=list)  # train_log.jsonl
    epochs: list[dict] = field(default_factory=list)  # metrics.jsonl
    summary: dict = field(default_factory=dict)  # summary.json

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def headline(self) -> str:
        return self.summary.get("headline", "loss")

    @property
    def higher_is_better(self) -> bool:
        return bool(self.summary.get("higher_is_better", False))

    def val_values(self, metric: str | None = None) -> list[float]:
        key = f"val_{metric or self.headline}"
        return [record[key] for record in self.epochs if _is_number(record.get(key))]

    def best(self) -> float | None:
        values = self.val_values()
        if not values:
            return None
        return max(values) if self.higher_is_better else min(values)

    def learning_rates(self) -> dict[str, list[tuple[int, float]]]:
        """Each parameter group's logged rate, (step, rate) by group (train_log's lr/<group>;
        a log without them, lr alone). Groups at the same rate throughout share one entry,
        named by all of them ("decay, no_decay")."""
        groups = list(dict.fromkeys(key for window in self.windows for key in window
                                    if key.startswith("lr/"))) or ["lr"]
        curves: dict[tuple, list[str]] = {}
        for key in groups:
            points = tuple((w["step"], w[key]) for w in self.windows if _is_number(w.get(key)))
            if points:
                curves.setdefault(points, []).append(key.removeprefix("lr/"))
        return {", ".join(names): list(points) for points, names in curves.items()}


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash: the rest is still useful
            continue
    return records


def read_run(path: Path) -> RunHistory:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a run folder")
    summary_path = path / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return RunHistory(path, _read_jsonl(path / "train_log.jsonl"),
                      _read_jsonl(path / "metrics.jsonl"), summary)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: list[RunHistory], out: Path, title: str = "") -> Path:
    """One PNG, three panels: loss (training windows, validation per epoch), the headline
    validation metric, the learning rate; one colour per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    loss_ax, metric_ax, lr_ax = axes
    headlines = sorted({run.headline for run in runs})
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        label = run.name if len(runs) > 1 else None
        steps = [w["step"] for w in run.windows if _is_number(w.get("loss"))]
        loss_ax.plot(steps, [w["loss"] for w in run.windows if _is_number(w.get("loss"))],
                     color=color, alpha=0.8, label=f"{label} train" if label else "train")
        val_loss = [(e["step"], e["val_loss"]) for e in run.epochs if _is_number(e.get("val_loss"))]
        if val_loss:
            loss_ax.plot(*zip(*val_loss, strict=True), color=color, linestyle="--", marker=".",
                         label=f"{label} val" if label else "val")
        points = [(e["step"], e[f"val_{run.headline}"]) for e in run.epochs
                  if _is_number(e.get(f"val_{run.headline}"))]
        if points:
            metric_ax.plot(*zip(*points, strict=True), color=color, marker=".",
                           label=label or f"val {run.headline}")
        rates = run.learning_rates()
        for style, (groups, points) in zip(itertools.cycle(LINE_STYLES), rates.items()):
            group = groups if len(rates) > 1 else None  # one curve: named by the run alone
            lr_ax.plot(*zip(*points, strict=True), color=color, linestyle=style,
                       label=" ".join(part for part in (label, group) if part) or None)
    loss_ax.set(title="loss", xlabel="step")
    metric_ax.set(title=f"validation {' / '.join(headlines)}", xlabel="step")
    lr_ax.set(title="learning rate", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def comparison(runs: list[RunHistory]) -> list[dict]:
    """One row per run: how it ended, its last and best headline validation value, and the last
    epoch's training loss and time; ranked best first (runs without a value last)."""
    rows = []
    for run in runs:
        last = run.epochs[-1] if run.epochs else {}
        values = run.val_values()
        rows.append({
            "run": run.name, "status": run.summary.get("status", "unknown"),
            "metric": f"val_{run.headline}", "best": run.best(),
            "last": values[-1] if values else None,
            "epochs": last.get("epoch"), "steps": last.get("step"),
            "train_loss": last.get("train_loss"),
            "train_seconds": sum(e.get("train_seconds", 0.0) for e in run.epochs),
        })
    return rank(rows, higher_is_better=all(run.higher_is_better for run in runs))


def rank(rows: list[dict], higher_is_better: bool, key: str = "best") -> list[dict]:
    """Rows sorted best first by `key`; rows without a number go last, in their order."""
    scored = [row for row in rows if _is_number(row.get(key))]
    scored.sort(key=lambda row: row[key], reverse=higher_is_better)
    return scored + [row for row in rows if not _is_number(row.get(key))]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no runs)\n"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_table(rows: list[dict], stem: Path) -> list[Path]:
    """`stem`.csv and `stem`.md; returns both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = stem.with_suffix(".csv"), stem.with_suffix(".md")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    md_path.write_text(markdown_table(rows))
    return [csv_path, md_path]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Overlay the curves of runs and compare them.")
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (runs/<name>-<time>)")
    parser.add_argument("--out", type=Path, default=Path("runs/report"),
                        help="folder for report.png, report.csv and report.md")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.runs if not path.exists()]
    if missing:
        print(f"error: {', '.join(missing)} not found: pass run folders of train.py",
              file=sys.stderr)
        return 2
    try:
        found = [read_run(path) if path.is_dir() else None for path in args.runs]
    except json.JSONDecodeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # runs/* also names mlflow.db, mlartifacts/, sweeps/, report/: passed over, in one line.
    logged = [run is not None and bool(run.windows or run.epochs) for run in found]
    runs = [run for run, kept in zip(found, logged, strict=True) if kept]
    skipped = [path.name for path, kept in zip(args.runs, logged, strict=True) if not kept]
    if not runs:
        print(f"error: no training log in {', '.join(skipped)}: pass run folders of train.py",
              file=sys.stderr)
        return 2
    if skipped:
        print(f"skipped (not run folders of train.py): {', '.join(skipped)}", file=sys.stderr)
    rows = comparison(runs)
    png = plot_runs(runs, args.out / "report.png")
    tables = write_table(rows, args.out / "report")
    print(markdown_table(rows), end="")
    print(f"wrote {png}, {', '.join(str(path) for path in tables)}")
    return 0

