"""The collate of a dataset builder that gives none (Splits.collate=None): torch's
default_collate, with a batch it cannot stack said in one line. Samples of different shapes
(token sequences of different lengths, say) need a collate of the builder's own that pads them;
torch's own error is a traceback ending in "stack expects each tensor to be equal size"."""

from torch.utils.data import default_collate

from ddpkit.streams import DataError


def stacking_collate(samples: list, dataset: str = ""):
    """torch's default_collate, for a builder that gives no collate of its own. Samples it
    cannot stack (sequences of different lengths, say) are one line naming where their shapes
    differ and the fix: a DataError, which stays one line from a loader worker too."""
    try:
        return default_collate(samples)
    except RuntimeError as error:
        if not any(sign in str(error) for sign in ("stack expects each tensor to be equal size",
                                                   "each element in list of batch should be")):
            raise
        where, shapes = first_difference(samples)
        raise DataError(
            f"data.dataset={dataset}: the samples of a batch differ in shape at {where} "
            f"({', '.join(str(list(shape)) for shape in shapes[:4])}), which torch's default "
            "collate cannot stack: give the dataset builder a collate that pads them, "
            "Splits(collate=...) in data_sources.py") from None


def first_difference(samples: list) -> tuple[str, list[tuple]]:
    """Where the samples' shapes first differ (sample[0], sample['tokens'], ...), and the
    shapes found there."""
    for column in zip(*(list(shapes_in(sample)) for sample in samples), strict=False):
        shapes = list(dict.fromkeys(shape for _, shape in column))
        if len(shapes) > 1:
            return column[0][0], shapes
    return "sample", []


def shapes_in(sample, where: str = "sample"):
    """(where, shape) of each tensor or array of a sample, nested in tuples, lists and dicts (a
    list or tuple's shape: its length)."""
    if hasattr(sample, "shape"):
        yield where, tuple(sample.shape)
    elif isinstance(sample, dict):
        for key, value in sample.items():
            yield from shapes_in(value, f"{where}[{key!r}]")
    elif isinstance(sample, (list, tuple)):
        yield where, (len(sample),)
        for index, value in enumerate(sample):
            yield from shapes_in(value, f"{where}[{index}]")
