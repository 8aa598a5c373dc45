"""The `gpt` workload's model, data and task, shared by both contenders of bench.py.

A nanoGPT-class language model (6 blocks of width 384, 6 heads, a context of 64 tokens, a
vocabulary of 4,096, the embedding tied to the output layer: 12.2M parameters) on a corpus
generated on the spot (nothing downloaded): 2^22 tokens made of 2,000 random 16-token phrases
drawn at random, so there is something to learn. Every offset of the corpus starts a training
sample (as nanoGPT's get_batch draws them), so the training split has about 4.2 million samples;
validation takes 256 windows of the held-out end, one every 64 tokens.

The template reaches it through its own extension points, the `path/file.py:name` form of
data.dataset, model.name and task.name (README: "Bring your own"):

    model.name=<bench>/gpt.py:build_gpt data.dataset=<bench>/gpt.py:tokens
    task.name=<bench>/gpt.py:LanguageModel

bench/handwritten.py --workload gpt imports the same model and corpus.
"""

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CONTEXT, WIDTH, HEADS, BLOCKS = 4096, 64, 384, 6, 6
TOKENS, PHRASES, PHRASE = 2**22, 2000, 16
VAL_WINDOWS = 256  # validation and test: this many windows each, one every CONTEXT tokens


def corpus(seed: int = 0) -> torch.Tensor:
    """The token stream (int32): random phrases, each drawn at random, end to end."""
    rng = np.random.default_rng(seed)
    phrases = rng.integers(0, VOCAB, (PHRASES, PHRASE), dtype=np.int32)
    order = rng.integers(0, PHRASES, TOKENS // PHRASE)
    return torch.from_numpy(phrases[order].reshape(-1))


def held_out() -> int:
    """Where the training tokens end: the last 2 x VAL_WINDOWS x CONTEXT (+1) are val, test."""
    return TOKENS - 2 * VAL_WINDOWS * CONTEXT - 1


def windows(stream: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples that begin at `starts`: inputs and next-token targets, [n, CONTEXT] each."""
    index = starts.reshape(-1, 1) + torch.arange(CONTEXT + 1)
    chunk = stream[index].long()
    return chunk[:, :-1], chunk[:, 1:]


class Windows(torch.utils.data.Dataset):
    """Samples of CONTEXT tokens and their next tokens, starting every `stride` tokens of
    `stream`; a list of indices reads a whole batch at once (batch_indexing)."""

    batch_indexing = True

    def __init__(self, stream: torch.Tensor, stride: int = 1):
        self.stream, self.stride = stream, stride

    def __len__(self) -> int:
        return (len(self.stream) - CONTEXT - 1) // self.stride + 1

    def __getitem__(self, index):
        starts = torch.as_tensor(index) * self.stride
        x, y = windows(self.stream, starts)
        return (x, y) if starts.dim() else (x[0], y[0])


def tokens(cfg=None):
    """The template's data builder (data.dataset=.../gpt.py:tokens)."""
    from ddpkit.splits import Splits

    stream, end = corpus(), held_out()
    span = VAL_WINDOWS * CONTEXT + 1
    return Splits(Windows(stream[:end]), Windows(stream[end:end + span], CONTEXT),
                  Windows(stream[end + span - 1:], CONTEXT), task="multiclass",
                  num_classes=VOCAB)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as nanoGPT
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * BLOCKS) if name.endswith(("proj.weight", "2.weight")) \
                    else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_gpt(cfg=None, input_shape=None, num_outputs=None) -> GPT:
    """The template's model builder (model.name=.../gpt.py:build_gpt)."""
    return GPT()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@functools.cache
def language_model_task():
    """The template's task class, made on first use (the engine's Task is imported late, so
    that handwritten.py can import this file without the template)."""
    from ddpkit.tasks import Task

    class LanguageModel(Task):
        """Next-token cross-entropy; validation reports the loss (rows: each sample's)."""

        metric_names = ()
        row_width = 1

        def __init__(self, cfg, splits, eval_cfg=None):
            super().__init__(cfg, splits, eval_cfg)
            self.num_outputs = splits.num_classes

        def loss(self, outputs, batch):
            return lm_loss(self.scores(outputs), self.targets(batch))

        def rows(self, outputs, batch):
            logits = self.scores(outputs)
            each = F.cross_entropy(logits.transpose(1, 2), self.targets(batch), reduction="none")
            return each.mean(1, keepdim=True).double()

        def metrics(self, rows, reference=None, detail=True):
            return {}

        def predictions(self, rows):
            return {"loss": rows[:, 0].cpu().numpy()}

    return LanguageModel


def __getattr__(name: str):
    if name == "LanguageModel":
        return language_model_task()
    raise AttributeError(name)
