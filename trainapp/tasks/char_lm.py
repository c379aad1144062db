"""The built-in character-level language model (`task.name=char_lm`): a small causal transformer (the
shape of nanoGPT's, a few hundred thousand parameters) that learns to predict the next character of
a text. The default text ships with trainapp (trainapp/tasks/text/, Chapters 1-41 of Moby-Dick, public
domain); `task.args.text=PATH` trains on any UTF-8 file instead. Evaluation reports the validation
loss in nats per character (`val_loss`) and in bits per character (`val_bpc`); the uniform guess over
the text's characters scores log(vocabulary size).
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from trainapp.config import ConfigError

if TYPE_CHECKING:
    from trainapp.tasks.api import TaskContext


def read_text(path: str | None) -> str:
    if path is None:
        return resources.files("trainapp.tasks").joinpath("text/corpus.txt").read_text(encoding="utf-8")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"task.args.text={path}: cannot read it as UTF-8 text "
                          f"({e.__class__.__name__}: {e})") from None


class Windows(torch.utils.data.Dataset):
    """(input, target) pairs of `block` characters, the target shifted by one, every `stride`
    characters of `ids`."""

    def __init__(self, ids: torch.Tensor, block: int, stride: int):
        self.ids, self.block, self.stride = ids, block, stride
        self.n = max(0, (len(ids) - block - 1) // stride + 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.stride:i * self.stride + self.block + 1].long()
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each added to the residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.drop(self.tok(idx) + self.pos(pos)))))


class CharLM:
    """Next-character prediction on a text: the first `1 - val_fraction` of it trains (a window every
    `stride` characters), the rest validates (windows side by side, each character scored once).
    `task.name=char_lm` makes it with `task.args` as its arguments."""

    random_items = False  # windows of a fixed text: nothing random in reading one

    def __init__(self, text: str | None = None, block_size: int = 64, stride: int = 16,
                 val_fraction: float = 0.1, n_layer: int = 2, n_head: int = 4, n_embd: int = 96,
                 dropout: float = 0.0):
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1")
        if block_size < 2 or stride < 1:
            raise ValueError(f"block_size={block_size} must be >= 2 and stride={stride} >= 1")
        self.text, self.block, self.stride, self.val_fraction = text, block_size, stride, val_fraction
        self.shape = (n_layer, n_head, n_embd, dropout)
        self.vocab: list[str] = []

    def datasets(self, ctx: TaskContext) -> tuple[Windows, Windows]:
        text = read_text(self.text)
        self.vocab = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.vocab)}
        ids = torch.tensor([index[ch] for ch in text], dtype=torch.int32)
        cut = int(len(ids) * (1 - self.val_fraction))
        train, val = Windows(ids[:cut], self.block, self.stride), Windows(ids[cut:], self.block, self.block)
        if len(val) == 0:
            raise ConfigError(f"task.args.text={self.text}: {len(text)} characters are too few for a "
                              f"validation window of block_size={self.block}; use a longer text or a larger "
                              f"val_fraction")
        return train, val

    def model(self, ctx: TaskContext) -> nn.Module:
        return CharTransformer(len(self.vocab), self.block, *self.shape)

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def evaluate(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> dict[str, torch.Tensor | int]:
        x, y = batch
        nll = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum")
        return {"loss": nll, "bpc": nll / math.log(2), "count": y.numel()}

