"""Models for test_equivalence.py, on the 16-feature vectors of tests/fixtures.py.

Runs name them by file: model.name=tests/equivalence_models.py:attention.
"""

import torch
import torch.distributed as dist
from torch import nn

TOKENS = 4  # the 16 features as 4 tokens of 4


class Attention(nn.Module):
    """Self-attention over 4 tokens, mean-pooled into a classifier. The key part of the
    attention's packed input bias has no true gradient: softmax ignores what is added to every
    score of a query alike."""

    def __init__(self, features: int, num_classes: int, width: int):
        super().__init__()
        self.embed = nn.Linear(features // TOKENS, width)
        self.attention = nn.MultiheadAttention(width, num_heads=2, batch_first=True)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.reshape(len(x), TOKENS, -1))
        mixed, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head((tokens + mixed).mean(1))


def attention(cfg, input_shape: tuple, num_classes: int) -> nn.Module:
    return Attention(input_shape[0], num_classes, cfg.hidden_dim)


class WorldSizeDrift(nn.Module):
    """A linear classifier whose head.bias gradient gets 0.05 x the world size added: its
    training depends on the process count, as a real bug's would."""

    def __init__(self, features: int, num_classes: int, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width), nn.ReLU())
        self.head = nn.Linear(width, num_classes)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.head.bias.register_hook(lambda grad: grad + 0.05 * world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def world_size_drift(cfg, input_shape: tuple, num_classes: int) -> nn.Module:
    return WorldSizeDrift(input_shape[0], num_classes, cfg.hidden_dim)


def tiny_bert(cfg, input_shape: tuple, num_classes: int) -> nn.Module:
    """A 2-layer BERT of Hugging Face transformers over the vectors as 4 token embeddings."""
    from transformers import BertConfig, BertForSequenceClassification

    bert = BertForSequenceClassification(BertConfig(
        vocab_size=8, hidden_size=cfg.hidden_dim, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * cfg.hidden_dim, max_position_embeddings=TOKENS,
        num_labels=num_classes, hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout))
    return Bert(bert, input_shape[0] // TOKENS, cfg.hidden_dim)


class Bert(nn.Module):
    def __init__(self, bert: nn.Module, token_features: int, width: int):
        super().__init__()
        self.embed = nn.Linear(token_features, width)
        self.bert = bert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embeddings = self.embed(x.reshape(len(x), TOKENS, -1))
        return self.bert(inputs_embeds=embeddings).logits


class Float32Only(nn.Module):
    """A classifier that casts its inputs to float32: it cannot run in float64."""

    def __init__(self, features: int, num_classes: int):
        super().__init__()
        self.head = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.float())


def float32_only(cfg, input_shape: tuple, num_classes: int) -> nn.Module:
    return Float32Only(input_shape[0], num_classes)
