"""Sampled loss estimates: the loss over a fixed set of random windows of the training and the
validation split, logged at each validation beside the exact one (train.estimate_windows=K).

For training data drawn with replacement (streams.SampledStream: data.dataset=tokens), as
nanoGPT's `estimate_loss` gives them: `sampled_train_loss` and `sampled_val_loss` in
metrics.jsonl (as val_sampled_train_loss and val_sampled_val_loss). The K windows are drawn once
from run.seed with the estimates' own key (the same at every validation, so one validation
compares with the next, and the same at any process count: rank r scores the r-th block of
them), and evaluated as evaluate.py evaluates a split: each once, the loss summed exactly. The
exact validation over the whole split (or its first train.limit_val_batches batches) stays.
"""

from torch.utils.data import DataLoader

from ddpkit.data import DataModule
from ddpkit.evaluation import evaluate_split
from ddpkit.streams import EvalPlan, RankStream, SampledStream


def estimate_streams(data: DataModule) -> dict[str, SampledStream]:
    """The drawn splits an estimate reads: the training split, and its validation twin (a
    SampledStream's `val_windows`, as the tokens dataset gives it), where there are any."""
    train = data.splits.train
    if not isinstance(train, SampledStream):
        return {}
    streams = {"train": train}
    if isinstance(getattr(train, "val_windows", None), SampledStream):
        streams["val"] = train.val_windows
    return streams


def estimate_loader(data: DataModule, stream: SampledStream, windows: int) -> DataLoader:
    """This rank's block of the `windows` estimate windows of `stream`, in batches of
    eval.batch_size (read in this process: a few batches, no loader workers)."""
    plan = EvalPlan(windows, data.cfg.eval.batch_size, data.env.world_size, data.env.rank)
    return DataLoader(RankStream(stream, plan, data.cfg.run.seed, data.collate),
                      batch_size=None)


def with_estimates(run, val: dict) -> dict | None:
    """`val` with sampled_<split>_loss of each drawn split added (train.estimate_windows > 0);
    None when a preemption signal cut an estimate short (as evaluate_split returns)."""
    windows = run.cfg.train.get("estimate_windows", 0)
    streams = estimate_streams(run.data) if windows else {}
    for split, stream in streams.items():
        estimate = evaluate_split(run.model_for_evaluation(),
                                  estimate_loader(run.data, stream, windows), run.device,
                                  run.task, run.speed, detail=False, supervisor=run.supervisor)
        if estimate is None:
            return None
        val = {**val, f"sampled_{split}_loss": estimate["loss"]}
    return val
