"""Language models: the next-token task and a small decoder-only transformer of the template's own.

`task.name=next_token` (tasks.NextTokenTask, the task of `data.dataset=tokens`; its methods are
NextTokenMixin's, here) scores a model that predicts each next token. The model may return the
logits of every position, `[batch, time, vocab]`, as a tensor, as the first element of a tuple
(nanoGPT's `(logits, loss)`), or as a Hugging Face causal-LM output (`.logits`): no wrapper is
needed. As every task does, it computes the loss itself (cross-entropy over every position) and
ignores one the model returns. Evaluation keeps four sums per window (negative log-likelihood,
correct predictions, tokens, characters), so the loss, perplexity, bits per token (and per
character, where the data says how many characters a token stands for) and next-token accuracy
of a split are exact at any process count, and in constant memory with eval.binned_thresholds
above 0.

`model.name=gpt` builds `TinyGPT`: token and position embeddings, pre-norm blocks of causal
self-attention (torch's scaled_dot_product_attention, which picks a fused kernel where there is
one) and an MLP, a final LayerNorm and a head that shares the token embedding's weights.
model.hidden_dim is its width, model.num_layers its blocks, model.dropout its dropout; heads of
64 dimensions when the width is a multiple of 64, else one head (or `model.num_heads`, declared
in settings.py). Its context is the data's window (data.block_size).
"""

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from ddpkit.config import UserError

LN2 = math.log(2.0)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Half-precision logits (autocast) in float32 for the loss; float32 and float64 as they are."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


# --- the task -----------------------------------------------------------------------------------

class NextTokenMixin:
    """Next-token prediction over windows of token ids: (inputs, targets), each [time]. The
    task is `tasks.NextTokenTask`, this on top of `tasks.Task` (kept here, beside the model,
    so that this module needs nothing of tasks.py)."""

    headline = "loss"
    metric_names = ("perplexity", "bits_per_token", "bits_per_character", "accuracy")
    higher_is_better = False
    row_width = 4  # per window: NLL (nats), correct predictions, tokens, characters
    # The logits as they come: in float64 they would take 8 bytes x batch x time x vocabulary
    # (3.3 GB for 8 windows of 1024 tokens over GPT-2's vocabulary); rows() goes window by
    # window in float32 and sums in float64.
    outputs_in_float64 = False

    def __init__(self, cfg: DictConfig, splits, eval_cfg: DictConfig | None = None):
        super().__init__(cfg, splits, eval_cfg)
        if splits.num_classes < 2:
            raise UserError("task.name=next_token needs token data: its dataset's "
                            "Splits(num_classes=...) must give the vocabulary size")
        self.num_outputs = splits.num_classes
        # Characters per token id (bits per character), where the data gives them.
        self.characters = getattr(splits.train, "token_characters", None)

    def scores(self, outputs) -> torch.Tensor:
        if isinstance(outputs, (tuple, list)):  # (logits, loss), as nanoGPT's model returns
            outputs = outputs[0]
        return super().scores(outputs)

    def logits_and_targets(self, outputs, batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits, targets = self.scores(outputs), self.targets(batch)
        if logits.dim() != 3 or logits.shape[:2] != targets.shape:
            wanted = [*targets.shape, self.num_outputs]
            raise UserError(f"task.name=next_token needs the logits of every position, "
                            f"[batch, time, vocab] = {wanted}, and the model returned "
                            f"{list(logits.shape)}: return every position's logits, not only "
                            "the last one's")
        return logits, targets

    def loss(self, outputs, batch) -> torch.Tensor:
        logits, targets = self.logits_and_targets(outputs, batch)
        return F.cross_entropy(at_least_float32(logits.flatten(0, 1)), targets.flatten())

    def train_scalars(self, outputs, batch) -> dict[str, torch.Tensor]:
        logits, targets = self.logits_and_targets(outputs, batch)
        return {"accuracy": (logits.argmax(-1) == targets).float().mean()}

    def tokens_per_sample(self, batch) -> int:
        """The tokens a sample trains on (tokens/s = samples/s x this)."""
        return int(self.targets(batch).shape[-1])

    def rows(self, outputs, batch) -> torch.Tensor:
        logits, targets = self.logits_and_targets(outputs, batch)
        nll = torch.stack([F.cross_entropy(at_least_float32(window), target, reduction="none")
                           for window, target in zip(logits, targets, strict=True)]).double()
        correct = (logits.argmax(-1) == targets).sum(1).double()
        tokens = torch.full_like(correct, targets.shape[1])
        characters = (self.characters.to(targets.device)[targets].sum(1)
                      if self.characters is not None else torch.zeros_like(correct))
        return torch.stack([nll.sum(1), correct, tokens, characters], dim=1)

    def metrics(self, rows, reference=None, detail=True) -> dict:
        return self.summary_metrics(rows.sum(0), 0)

    def summary_size(self, bins: int) -> int:
        return self.row_width

    def summarize(self, rows, bins):
        return rows.sum(0)  # sums: exact in constant memory

    def summary_metrics(self, totals, bins, reference=None, detail=True) -> dict:
        nll, correct, tokens, characters = totals.tolist()
        tokens = max(tokens, 1.0)
        result = {"perplexity": math.exp(min(nll / tokens, 700.0)),
                  "bits_per_token": nll / tokens / LN2, "accuracy": correct / tokens}
        if characters:
            result["bits_per_character"] = nll / characters / LN2
        return result

    def predictions(self, rows) -> dict:
        """Per window: its mean loss (nats per token) and its next-token accuracy."""
        return {"loss": (rows[:, 0] / rows[:, 2]).cpu().numpy(),
                "accuracy": (rows[:, 1] / rows[:, 2]).cpu().numpy()}


# --- the model ----------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.proj.residual = True  # initialised smaller: it adds to the residual stream
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (part.view(batch, time, self.heads, width // self.heads).transpose(1, 2)
                   for part in self.qkv(x).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, width)))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.mlp_norm = nn.LayerNorm(width)
        out = nn.Linear(4 * width, width, bias=False)
        out.residual = True
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(), out,
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer (the module's docstring): token ids [batch, time] in,
    logits [batch, time, vocab] out."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int,
                 dropout: float):
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one matrix reads and writes tokens
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                # GPT-2's initialisation; residual projections scaled by depth, so the residual
                # stream's variance does not grow with the number of blocks.
                scale = 1 / math.sqrt(2 * layers) if getattr(module, "residual", False) else 1
                nn.init.normal_(module.weight, std=0.02 * scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time = tokens.shape[1]
        if time > self.context:
            raise ValueError(f"TinyGPT got {time} tokens a sequence; its context is "
                             f"{self.context}")
        positions = torch.arange(time, device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_gpt(cfg: DictConfig, input_shape, num_outputs: int) -> TinyGPT:
    """model.name=gpt: a TinyGPT over the data's windows (input_shape: (block_size,))."""
    if not (isinstance(input_shape, tuple) and len(input_shape) == 1):
        raise UserError(f"model.name=gpt reads windows of token ids, and the data's samples have "
                        f"inputs of shape {input_shape}: use data.dataset=tokens, or a dataset "
                        "of token windows")
    if cfg.num_layers < 1:
        raise UserError("model.num_layers=0 leaves model.name=gpt without blocks: use 1 or more")
    width = cfg.hidden_dim
    heads = cfg.get("num_heads") or (width // 64 if width % 64 == 0 else 1)
    if width % heads:
        raise UserError(f"model.hidden_dim={width} does not split into {heads} attention heads: "
                        "choose a width that is a multiple of the heads")
    return TinyGPT(num_outputs, input_shape[0], width, cfg.num_layers, heads, cfg.dropout)


def logits_of(outputs) -> torch.Tensor:
    """The logits of a language model's output: a tensor, a tuple's first element, a dict's or a
    Hugging Face output's `logits`."""
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0]
    if isinstance(outputs, torch.Tensor):
        return outputs
    return outputs["logits"] if isinstance(outputs, Mapping) else outputs.logits


@torch.no_grad()
def generate(model: nn.Module, tokens: torch.Tensor, new_tokens: int, context: int,
             temperature: float = 1.0, top_k: int = 0,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """`tokens` [batch, time] continued by `new_tokens` tokens, each drawn from the model's
    prediction at the last position (seeing the last `context` tokens): logits divided by
    `temperature` (0: the most likely token), only the `top_k` most likely kept (0: all)."""
    for _ in range(new_tokens):
        logits = logits_of(model(tokens[:, -context:]))[:, -1, :].float()
        if temperature == 0:
            chosen = logits.argmax(-1, keepdim=True)
        else:
            # Less the largest first: a tiny temperature then sends the others to -inf, never
            # the likeliest to inf (inf - inf: a NaN distribution); in float64, where any
            # positive temperature stays above 0.
            logits = (logits - logits.max(-1, keepdim=True).values).double() / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            chosen = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        tokens = torch.cat([tokens, chosen], dim=1)
    return tokens


def pretrained_causal_lm(folder: str, input_shape: tuple, num_outputs: int,
                         setting: str = "model.pretrained") -> nn.Module:
    """A Hugging Face causal LM from a folder written by save_pretrained (nothing downloaded), for
    a builder of yours: checked against the data before its weights load (the vocabulary, the
    window), in float32 as the built-in models are (a model saved in bfloat16 loads in bfloat16;
    speed.precision sets the passes' precision). `setting` names the folder's setting in errors."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    if not Path(folder, "config.json").is_file():
        raise UserError(f"{setting}={folder!r} is not a folder written by save_pretrained (it "
                        "has no config.json): set it to one")
    config = AutoConfig.from_pretrained(folder)
    if config.vocab_size < num_outputs:
        raise UserError(f"{setting}={folder} knows {config.vocab_size} tokens, fewer than the "
                        f"data's {num_outputs}: prepare the text with its tokenizer (python -m "
                        "ddpkit.tokens ... --tokenizer)")
    context = getattr(config, "max_position_embeddings", None) or input_shape[0]
    if input_shape[0] > context:
        raise UserError(f"data.block_size={input_shape[0]} is more than the {context} positions "
                        f"of {setting}={folder}: lower data.block_size")
    return AutoModelForCausalLM.from_pretrained(folder).float()


def flops_per_token(model: TinyGPT, time: int) -> float:
    """Training FLOPs per token by the usual estimate (PaLM, nanoGPT): 6 x the parameters that
    multiply (all but the position embedding; the tied head counted once, as the product it
    does), plus attention's 12 x layers x width x time."""
    matmul = sum(p.numel() for p in model.parameters()) - model.position_embedding.weight.numel()
    width = model.token_embedding.embedding_dim
    return 6 * matmul + 12 * len(model.blocks) * width * time
