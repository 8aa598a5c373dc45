"""Tasks: what the model predicts and how it is scored. Each is a class in `TASKS`.

This file is the template's (`cruft update` brings its fixes in): it holds the interface, the
built-in tasks and `build_task`. Add your tasks to tasks.py, which is yours and which the
template imports before any task is looked up.

A task owns everything that depends on what the model's outputs mean, so the training loop and
the evaluation never do:

    loss(outputs, batch)           the training objective: a tensor, or a dict of named terms
                                   that are summed (each is logged as loss_<name>)
    train_scalars(outputs, batch)  more numbers to log every step (means over the batch)
    rows(outputs, batch)           what evaluation keeps of each sample (float64), gathered from
                                   every rank in the split's own order
    metrics(rows, reference)       the numbers of the whole split, computed once from all rows;
                                   `headline` names the one that ranks runs
    write_outputs(...)             curves (JSON), plots (PNG) and TensorBoard extras

Built in, each checked against scikit-learn at 1, 2 and 3 processes:

    multiclass  cross-entropy; accuracy, confusion matrix, per-class PR curves, AP per class,
                macro and micro
    binary      one logit, BCE (task.pos_weight); PR curve, AP and ROC AUC of the positive
                class; precision, recall, F1 and accuracy at the threshold with the best F1 on
                the validation split
    regression  MSE on standardised targets; MAE, RMSE and R^2 in the data's own units
    next_token  a language model's cross-entropy; perplexity, bits per token (and character),
                next-token accuracy (ddpkit/lm.py)

Batches may be tuples `(inputs, target)` or dicts: the target under `task.target_key`, every
other entry a keyword argument of the model. A model may return a tensor, a dict with `logits`
or an object with a `logits` attribute (a Hugging Face ModelOutput). The task always computes
the loss itself and ignores a `loss` the model returns: its own reduction is the same at every
process count and batch split, which a model's loss (a mean over a padded batch, say) need not
be. To change any of that, subclass a task in tasks.py and register it there.
"""

import difflib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ddpkit import metrics as M
from ddpkit.config import UserError, lookup
from ddpkit.lm import NextTokenMixin
from ddpkit.splits import Splits


class Task:
    """The interface the trainer and the evaluation use; subclasses fill in the rest."""

    headline = "loss"  # the metric that ranks runs and checkpoints
    # The metrics a validation gives besides `loss` (and a dict loss's `loss_<term>`): declared,
    # a typo in train.best_metric is refused before training starts; None: found at the first
    # validation.
    metric_names: tuple[str, ...] | None = None
    higher_is_better = False
    output_key = "logits"  # what to read from a model that returns a dict
    target_key = "target"  # what to read from a batch that is a dict
    needs_reference = False  # metrics of a test split use the val split's (e.g. a threshold)
    row_width = 2  # float64 numbers evaluation keeps per sample
    outputs_in_float64 = True  # evaluation hands loss() and rows() the outputs in float64

    def __init__(self, cfg: DictConfig, splits: Splits, eval_cfg: DictConfig | None = None):
        self.cfg, self.splits = cfg, splits
        self.target_key = cfg.get("target_key") or self.target_key
        self.curve_points = eval_cfg.curve_points if eval_cfg else 200
        self.plot_classes = eval_cfg.plot_classes if eval_cfg else 10
        self.num_outputs = 1

    # -- what the model and the loss read ---------------------------------------------------------

    def model_inputs(self, batch):
        """What the model is called with (models.call_model): a dict batch less its target (as
        keyword arguments), else its first element."""
        if isinstance(batch, dict):
            if self.target_key not in batch:
                raise UserError(f"task.target_key={self.target_key} is not a key of the dict "
                                f"samples ({', '.join(sorted(batch))}): set it to the key of the "
                                "target")
            return {key: value for key, value in batch.items() if key != self.target_key}
        return batch[0]

    def targets(self, batch) -> torch.Tensor:
        return batch[self.target_key] if isinstance(batch, dict) else batch[1]

    def scores(self, outputs) -> torch.Tensor:
        """The tensor the task scores, from a model output that is a tensor, a dict or an
        object with that attribute (a Hugging Face ModelOutput is both)."""
        if isinstance(outputs, torch.Tensor):
            return outputs
        if isinstance(outputs, Mapping):
            return outputs[self.output_key]
        return getattr(outputs, self.output_key)

    def input_shape(self, sample) -> tuple | dict:
        """Shape of one sample's model inputs: what model builders receive."""
        inputs = self.model_inputs(sample)
        if isinstance(inputs, dict):
            return {key: tuple(value.shape) for key, value in inputs.items()
                    if isinstance(value, torch.Tensor)}
        return tuple(inputs.shape)

    # -- training ---------------------------------------------------------------------------------

    def loss(self, outputs, batch) -> torch.Tensor | dict[str, torch.Tensor]:
        """The mean loss over the batch: a tensor, or a dict of named terms that are summed."""
        raise NotImplementedError

    def train_scalars(self, outputs, batch) -> dict[str, torch.Tensor]:
        """Numbers logged every step besides the loss, each a mean over the batch. `outputs`
        are detached from the graph: nothing computed here is differentiated."""
        return {}

    def tokens_per_sample(self, batch) -> int | None:
        """The tokens a sample trains on, where that means something (a language model's
        window): the log then gives tokens/s and FLOPs per token too. None: it does not."""
        return None

    # -- evaluation -------------------------------------------------------------------------------

    def rows(self, outputs, batch) -> torch.Tensor:
        """float64 [samples, row_width]: what metrics() needs of each sample."""
        raise NotImplementedError

    def metrics(self, rows: torch.Tensor, reference: dict | None = None,
                detail: bool = True) -> dict:
        """Metrics of a whole split from all its rows (every rank gets the same rows). Floats
        at the top level are logged; `curves` holds what goes to curves.json. `reference`: the
        val split's metrics when this split is another one. `detail=False` (validation during
        training) may skip what only the written outputs need."""
        raise NotImplementedError

    def summary_size(self, bins: int) -> int:
        """Length of the fixed-size summary of the binned mode (eval.binned_thresholds)."""
        raise UserError(f"task {type(self).__name__} has no binned mode: set "
                        "eval.binned_thresholds=0")

    def summarize(self, rows: torch.Tensor, bins: int) -> torch.Tensor:
        """Binned mode: a batch's rows as a fixed-size float64 summary that adds up over
        batches and ranks."""
        raise NotImplementedError

    def summary_metrics(self, totals: torch.Tensor, bins: int, reference: dict | None = None,
                        detail: bool = True) -> dict:
        raise NotImplementedError

    def predictions(self, rows: torch.Tensor) -> dict[str, np.ndarray]:
        """Arrays for predictions.npz (eval.save_predictions), in split order."""
        return {"targets": rows[:, 0].cpu().numpy(), "predictions": rows[:, 1:].cpu().numpy()}

    def write_outputs(self, result: dict, out_dir: Path, writer, step: int, split: str
                      ) -> list[str]:
        """Plots and TensorBoard extras of an evaluation; returns the files written."""
        return []


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    return plt


# --- multiclass ----------------------------------------------------------------------------------

class MulticlassTask(Task):
    headline = "accuracy"
    metric_names = ("accuracy", "average_precision_macro")
    higher_is_better = True

    def __init__(self, cfg: DictConfig, splits: Splits, eval_cfg: DictConfig | None = None):
        super().__init__(cfg, splits, eval_cfg)
        if splits.num_classes < 2:
            raise UserError("task.name=multiclass needs data with at least 2 classes: this "
                            f"dataset has num_classes={splits.num_classes}")
        self.num_outputs = splits.num_classes
        self.row_width = 1 + splits.num_classes  # target, class probabilities

    def loss(self, outputs, batch):
        return F.cross_entropy(self.scores(outputs), self.targets(batch))

    def train_scalars(self, outputs, batch):
        predicted = self.scores(outputs).argmax(dim=-1)
        return {"accuracy": (predicted == self.targets(batch)).float().mean()}

    def rows(self, outputs, batch):
        probabilities = self.scores(outputs).double().softmax(dim=-1)
        return torch.cat([self.targets(batch).double()[:, None], probabilities], dim=1)

    def metrics(self, rows, reference=None, detail=True):
        labels, probabilities = rows[:, 0].long(), rows[:, 1:]
        classes = self.num_outputs
        confusion = M.confusion_matrix(labels, probabilities.argmax(dim=1), classes)
        # Every class's exact AP in a few vectorised passes; the curves behind them (a sort of
        # each column) only when they are written: at 1,000 classes they cost more than an epoch.
        per_class = M.average_precision_per_class(probabilities, labels).tolist()
        result = {"accuracy": (confusion.trace().double() / max(len(rows), 1)).item(),
                  "average_precision_macro": sum(per_class) / classes}
        if detail:
            curves = [M.precision_recall_curve(probabilities[:, c], labels == c)
                      for c in range(classes)]
            onehot = torch.nn.functional.one_hot(labels, classes).bool()
            micro = M.precision_recall_curve(probabilities.flatten(), onehot.flatten())
            result["average_precision_micro"] = M.average_precision(*micro[:2])
            result.update(average_precision_per_class=per_class,
                          confusion_matrix=confusion.tolist(),
                          curves=self._curves([*curves, micro]))
        return result

    def _curves(self, curves: list) -> dict:
        """Thinned PR curves: one per class, then the micro average."""
        names = [str(c) for c in range(self.num_outputs)] + ["micro"]
        return {"pr": {name: M.thin({"precision": p, "recall": r, "thresholds": t}, "recall",
                                    "precision", self.curve_points)
                       for name, (p, r, t) in zip(names, curves, strict=True)}}

    def summary_size(self, bins):
        return self.num_outputs ** 2 + self.num_outputs * 2 * bins

    def summarize(self, rows, bins):
        labels, probabilities = rows[:, 0].long(), rows[:, 1:]
        classes = self.num_outputs
        confusion = M.confusion_matrix(labels, probabilities.argmax(dim=1), classes)
        counts = M.binned_counts_per_class(probabilities, labels, bins)
        return torch.cat([confusion.double().flatten(), counts.flatten()])

    def summary_metrics(self, totals, bins, reference=None, detail=True):
        classes = self.num_outputs
        confusion = totals[:classes * classes].reshape(classes, classes).long()
        counts = totals[classes * classes:].reshape(classes, 2, bins)
        curves = [M.binned_pr_curve(counts[c]) for c in range(classes)]
        per_class = [M.average_precision(p, r) for p, r, _ in curves]
        micro = M.binned_pr_curve(counts.sum(0))
        result = {"accuracy": (confusion.trace().double() / max(int(confusion.sum()), 1)).item(),
                  "average_precision_macro": sum(per_class) / classes,
                  "average_precision_micro": M.average_precision(*micro[:2])}
        if detail:
            result.update(average_precision_per_class=per_class,
                          confusion_matrix=confusion.tolist(),
                          curves=self._curves([*curves, micro]))
        return result

    def predictions(self, rows):
        return {"targets": rows[:, 0].long().cpu().numpy(),
                "predictions": rows[:, 1:].cpu().numpy()}

    def write_outputs(self, result, out_dir, writer, step, split):
        """pr_curves.png: the plot_classes classes with the lowest AP (all, when that many or
        fewer), and the micro average; TensorBoard gets the same curves as tables of points."""
        per_class, curves = result["average_precision_per_class"], result["curves"]["pr"]
        worst = sorted(range(len(per_class)), key=per_class.__getitem__)[:self.plot_classes]
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 6), dpi=120)
        for cls in sorted(worst):
            curve = curves[str(cls)]
            ax.step(curve["recall"], curve["precision"], where="post",
                    label=f"{cls}: AP {per_class[cls]:.3f}")
        micro = curves["micro"]
        ax.step(micro["recall"], micro["precision"], where="post", color="black", linewidth=2,
                label=f"micro: AP {result['average_precision_micro']:.3f}")
        shown = "" if len(worst) == len(per_class) else f", the {len(worst)} with the lowest AP"
        ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1.01), ylim=(0, 1.02),
               title=f"{split}: {len(per_class)} classes{shown}; macro AP "
                     f"{result['average_precision_macro']:.3f}")
        ax.grid(alpha=0.3)
        ax.legend(title="class", fontsize="small", loc="lower left", ncols=2)
        fig.tight_layout()
        fig.savefig(out_dir / "pr_curves.png")
        plt.close(fig)
        confusion = np.array(result["confusion_matrix"])
        positives, total = [*confusion.sum(axis=1).tolist()], int(confusion.sum())
        for name, curve in curves.items():  # micro: every (sample, class) pair is a case
            count, cases = ((total, total * len(per_class)) if name == "micro"
                            else (positives[int(name)], total))
            _tensorboard_curve(writer, f"{split}/pr_curve/class_{name}", curve, step, count,
                               cases)
        return ["pr_curves.png"]


def _tensorboard_curve(writer, tag: str, curve: dict, step: int, positives: int,
                       total: int) -> None:
    """A thinned PR curve (thresholds increasing, as TensorBoard orders them) as a TensorBoard
    PR curve: its points and the counts behind them, no raw scores."""
    points = len(curve["thresholds"])
    if points == 0:
        return
    precision = torch.tensor(curve["precision"][:points], dtype=torch.float64)
    recall = torch.tensor(curve["recall"][:points], dtype=torch.float64)
    true_pos = (recall * positives).round()
    predicted = torch.where(precision > 0, true_pos / precision.clamp(min=1e-12), true_pos)
    false_pos = (predicted - true_pos).round()
    writer.add_pr_curve_raw(tag, true_pos, false_pos, total - positives - false_pos,
                            positives - true_pos, precision, recall, step,
                            num_thresholds=points)


# --- binary --------------------------------------------------------------------------------------

class BinaryTask(Task):
    headline = "average_precision"
    metric_names = ("average_precision", "roc_auc", "precision", "recall", "f1", "accuracy",
                    "threshold")
    higher_is_better = True
    needs_reference = True  # the decision threshold of a test split is chosen on val

    def __init__(self, cfg: DictConfig, splits: Splits, eval_cfg: DictConfig | None = None):
        super().__init__(cfg, splits, eval_cfg)
        if splits.num_classes not in (0, 2):
            raise UserError(f"task.name=binary needs labels 0 and 1, and this dataset has "
                            f"{splits.num_classes} classes: use task.name=multiclass")
        self.pos_weight = cfg.pos_weight

    def logits(self, outputs) -> torch.Tensor:
        return self.scores(outputs).reshape(-1)  # one logit per sample

    def loss(self, outputs, batch):
        logits = self.logits(outputs)
        weight = None if self.pos_weight == 1 else logits.new_tensor(self.pos_weight)
        return F.binary_cross_entropy_with_logits(logits, self.targets(batch).to(logits.dtype),
                                                  pos_weight=weight)

    def train_scalars(self, outputs, batch):
        predicted = self.logits(outputs) > 0
        return {"accuracy": (predicted == self.targets(batch).bool()).float().mean()}

    def rows(self, outputs, batch):
        probability = self.logits(outputs).double().sigmoid()
        return torch.stack([self.targets(batch).double(), probability], dim=1)

    def metrics(self, rows, reference=None, detail=True):
        positive, scores = rows[:, 0] > 0.5, rows[:, 1]
        precision, recall, thresholds = M.precision_recall_curve(scores, positive)
        fpr, tpr, roc_thresholds = M.roc_curve(scores, positive)
        curves = {"pr": {"precision": precision, "recall": recall, "thresholds": thresholds},
                  "roc": {"fpr": fpr, "tpr": tpr, "thresholds": roc_thresholds}}
        at = M.counts_at_threshold
        return self._result(curves, lambda t: at(scores, positive, t), reference, detail)

    def _result(self, curves: dict, counts_at, reference: dict | None, detail: bool) -> dict:
        pr, roc = curves["pr"], curves["roc"]
        threshold = (reference["threshold"] if reference else
                     M.best_f1_threshold(pr["precision"], pr["recall"], pr["thresholds"]))
        at_threshold = counts_at(threshold)
        result = {"average_precision": M.average_precision(pr["precision"], pr["recall"]),
                  "roc_auc": M.roc_auc(roc["fpr"], roc["tpr"]),
                  "threshold": float(threshold),
                  **{name: at_threshold[name] for name in ("f1", "precision", "recall",
                                                           "accuracy")},
                  "positives": at_threshold["tp"] + at_threshold["fn"]}
        if detail:
            roc["thresholds"] = roc["thresholds"].clamp(max=1.0)  # +inf is not JSON
            result["curves"] = {
                "pr": M.thin(pr, "recall", "precision", self.curve_points),
                "roc": M.thin(roc, "fpr", "tpr", self.curve_points)}
            result["confusion"] = {k: at_threshold[k] for k in ("tp", "fp", "fn", "tn")}
        return result

    def summary_size(self, bins):
        return 2 * bins

    def summarize(self, rows, bins):
        return M.binned_counts(rows[:, 1], rows[:, 0] > 0.5, bins).flatten()

    def summary_metrics(self, totals, bins, reference=None, detail=True):
        counts = totals.reshape(2, bins)
        precision, recall, thresholds = M.binned_pr_curve(counts)
        fpr, tpr, roc_thresholds = M.binned_roc_curve(counts)
        curves = {"pr": {"precision": precision, "recall": recall, "thresholds": thresholds},
                  "roc": {"fpr": fpr, "tpr": tpr, "thresholds": roc_thresholds}}
        return self._result(curves, lambda t: M.binned_counts_at_threshold(counts, t),
                            reference, detail)

    def predictions(self, rows):
        return {"targets": rows[:, 0].long().cpu().numpy(),
                "predictions": rows[:, 1].cpu().numpy()}

    def write_outputs(self, result, out_dir, writer, step, split):
        """pr_curve.png: the PR curve (the decision threshold marked) and the ROC curve."""
        pr, roc = result["curves"]["pr"], result["curves"]["roc"]
        plt = _pyplot()
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5), dpi=120)
        left.step(pr["recall"], pr["precision"], where="post",
                  label=f"AP {result['average_precision']:.3f}")
        left.plot([result["recall"]], [result["precision"]], "o",
                  label=f"threshold {result['threshold']:.3f}: F1 {result['f1']:.3f}")
        left.set(xlabel="recall", ylabel="precision", xlim=(0, 1.01), ylim=(0, 1.02),
                 title=f"{split}: precision-recall, positive class")
        right.plot(roc["fpr"], roc["tpr"], label=f"AUC {result['roc_auc']:.3f}")
        right.plot([0, 1], [0, 1], ":", color="grey")
        right.set(xlabel="false positive rate", ylabel="true positive rate", xlim=(0, 1),
                  ylim=(0, 1.02), title=f"{split}: ROC")
        for ax in (left, right):
            ax.grid(alpha=0.3)
            ax.legend(loc="lower left" if ax is left else "lower right")
        fig.tight_layout()
        fig.savefig(out_dir / "pr_curve.png")
        plt.close(fig)
        counts = result["confusion"]
        _tensorboard_curve(writer, f"{split}/pr_curve", pr, step, result["positives"],
                           sum(counts.values()))
        return ["pr_curve.png"]


# --- regression ----------------------------------------------------------------------------------

class RegressionTask(Task):
    headline = "rmse"
    metric_names = ("mae", "rmse", "r2")
    higher_is_better = False

    def __init__(self, cfg: DictConfig, splits: Splits, eval_cfg: DictConfig | None = None):
        super().__init__(cfg, splits, eval_cfg)
        self.mean, self.std = float(splits.target_mean), float(splits.target_std) or 1.0

    def prediction(self, outputs) -> torch.Tensor:
        return self.scores(outputs).reshape(-1)

    def loss(self, outputs, batch):
        predicted = self.prediction(outputs)
        standardised = (self.targets(batch).to(predicted.dtype) - self.mean) / self.std
        return F.mse_loss(predicted, standardised)

    def rows(self, outputs, batch):
        """Target and prediction in the data's own units."""
        predicted = self.prediction(outputs).double() * self.std + self.mean
        return torch.stack([self.targets(batch).double(), predicted], dim=1)

    def summary_size(self, bins):
        return 5

    def summarize(self, rows, bins):
        """Exact in constant memory: regression metrics are sums."""
        target, error = rows[:, 0], rows[:, 1] - rows[:, 0]
        return torch.stack([target.new_tensor(float(len(rows))), error.abs().sum(),
                            error.square().sum(), target.sum(), target.square().sum()])

    def summary_metrics(self, totals, bins, reference=None, detail=True):
        count, abs_error, squared_error, target_sum, target_squares = totals.tolist()
        count = max(count, 1.0)
        spread = target_squares - target_sum * target_sum / count
        return {"mae": abs_error / count, "rmse": (squared_error / count) ** 0.5,
                "r2": 1.0 - squared_error / spread if spread > 0 else float("nan")}

    def metrics(self, rows, reference=None, detail=True):
        target, error = rows[:, 0], rows[:, 1] - rows[:, 0]
        count = max(len(rows), 1)
        spread = (target - target.mean()).square().sum().item() if len(rows) else 0.0
        squared = error.square().sum().item()
        return {"mae": error.abs().sum().item() / count, "rmse": (squared / count) ** 0.5,
                "r2": 1.0 - squared / spread if spread > 0 else float("nan")}


# --- next token ----------------------------------------------------------------------------------

class NextTokenTask(NextTokenMixin, Task):
    """A language model's next-token prediction: the methods are in ddpkit/lm.py."""


# Task classes take the `task` config section, the dataset's Splits and the `eval` section.
# Yours are added in tasks.py (or named on the command line as module:Class).
TASKS = {"multiclass": MulticlassTask, "binary": BinaryTask, "regression": RegressionTask,
         "next_token": NextTokenTask}


def check_best_metric(metric: str, tasks: list[type[Task]], where: str) -> None:
    """train.best_metric, when given, is a validation metric of one of `tasks` (the run's, or
    every registered one when the data's own task is not known yet); tasks that declare no
    metric_names accept any."""
    if not metric or any(task.metric_names is None for task in tasks):
        return
    names = ["loss", *dict.fromkeys(name for task in tasks for name in task.metric_names)]
    if metric in names or metric.startswith("loss_"):  # a dict loss logs each term
        return
    close = difflib.get_close_matches(metric, names, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise UserError(f"train.best_metric={metric} is not a validation metric of {where}: choose "
                    f"one of {', '.join(names)}{hint}")


def build_task(cfg: DictConfig, splits: Splits) -> Task:
    """The task of `task.name`, or the one the dataset is made for when that is empty."""
    name = cfg.task.name or splits.task
    key = "task.name" if cfg.task.name else f"the task of data.dataset={cfg.data.dataset}"
    return lookup(TASKS, name, key, "a task")(cfg.task, splits, cfg.eval)
