"""The sweep's summary, written when every trial has ended (or by `sweep.py --summary`):
summary.csv and summary.md, the trials ranked by the task's headline validation metric (a
failed trial with the line that says why, a pruned one marked so), and summary.png, the best
value of that metric against each swept setting."""

from pathlib import Path

from ddpkit import report
from ddpkit.extras.sweep.folder import Sweep, trial_id
from ddpkit.extras.sweep.local import error_line


def write_sweep_summary(sweep: Sweep) -> int:
    """summary.csv / .md (ranked) and summary.png; returns 0 if every trial finished."""
    rows, runs = [], []
    for index, settings in enumerate(sweep.trials):
        run_dir = sweep.run_dir(index)
        history = report.read_run(run_dir) if run_dir.is_dir() else None
        if history is not None:
            runs.append((settings, history))
        status = "finished" if sweep.finished(index) else "failed"
        if index in sweep.pruned:
            status = "pruned"
        row = {"trial": trial_id(index), **settings, "status": status,
               "metric": f"val_{history.headline}" if history else None,
               "best": history.best() if history else None,
               "last": (history.val_values() or [None])[-1] if history else None}
        if row["status"] == "failed":
            row["error"] = error_line(sweep.log_file(index))
        rows.append(row)
    higher = all(history.higher_is_better for _, history in runs) if runs else True
    rows = report.rank(rows, higher_is_better=higher)
    tables = report.write_table(rows, sweep.folder / "summary")
    png = plot_sweep(sweep, runs, sweep.folder / "summary.png")
    print(report.markdown_table(rows), end="")
    print(f"wrote {', '.join(str(path) for path in [*tables, png])}")
    return 0 if all(row["status"] in ("finished", "pruned") for row in rows) else 1


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def plot_sweep(sweep: Sweep, runs: list, out: Path) -> Path:
    """The best headline validation value of each trial against each swept setting."""
    plt = report._pyplot()
    keys = list(sweep.trials[0]) if sweep.trials else []
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.5 * max(1, len(keys)), 3.8),
                             squeeze=False)
    metric = f"val {runs[0][1].headline}" if runs else "val metric"
    for ax, key in zip(axes[0], keys, strict=False):
        points = [(settings[key], history.best()) for settings, history in runs
                  if history.best() is not None]
        numbers = [_number(value) for value, _ in points]
        if points and all(n is not None for n in numbers):
            ax.scatter(numbers, [best for _, best in points])
            positive = [n for n in numbers if n > 0]
            if len(positive) == len(numbers) and max(numbers) / min(numbers) >= 10:
                ax.set_xscale("log")
        elif points:
            labels = sorted({value for value, _ in points})
            ax.scatter([labels.index(value) for value, _ in points],
                       [best for _, best in points])
            ax.set_xticks(range(len(labels)), labels, rotation=30)
        ax.set(xlabel=key, ylabel=f"best {metric}")
        ax.grid(alpha=0.3)
    fig.suptitle(f"sweep {sweep.folder.name}: {len(runs)} of {len(sweep.trials)} trials")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
