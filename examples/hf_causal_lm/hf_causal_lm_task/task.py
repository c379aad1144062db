"""A Hugging Face `transformers` causal language model trained by trainapp, exported so that
`AutoModelForCausalLM.from_pretrained` loads it (docs/your-own-model.md, "A Hugging Face model").

    pip install 'transformers>=4.45'
    PYTHONPATH=examples/hf_causal_lm torchrun --standalone --nproc_per_node=2 -m trainapp train \
        --config examples/hf_causal_lm/config.yaml run.dir=runs/hf
    python -c "import transformers as t; print(t.AutoModelForCausalLM.from_pretrained('runs/hf/model/hf'))"

The model is built from a config (GPT-2's or Llama's), never downloaded: no weights, no tokenizer, no
network. The vocabulary is the 256 byte values, so a text is its UTF-8 bytes and a token is one byte:
`bytes(ids).decode(errors="replace")` reads a generation back, with nothing to ship beside the model.
The default text is the one trainapp's `char_lm` trains on (Moby-Dick, shipped in trainapp/tasks/text/).
Sizes are toy sizes (2 layers, 64 wide: 0.12 M parameters for GPT-2): `task.args` make them larger.

trainapp does the rest as for any task: the model it builds here is moved to the device, wrapped in DDP
(or sharded, `shard_units`), snapshotted and resumed; at the end of the run it is written to
`RUN_DIR/model/model.safetensors` (GPT-2's tied `lm_head.weight` and `transformer.wte.weight` stored
once), and then `export` below adds `RUN_DIR/model/hf/`. `trainapp export RUN_DIR --out DIR` does the
same from a snapshot, and `trainapp.load_model(DIR)` gives the model back as this task builds it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trainapp.errors import ConfigError  # a bad input: one line naming it, exit 2

VOCAB = 256
"""Byte values: the tokenizer is `text.encode("utf-8")`."""
ARCHS = ("gpt2", "llama")


def read_bytes(path: str | None) -> torch.Tensor:
    """The text's bytes as token ids: trainapp's shipped text, or the file at `path`."""
    shipped = resources.files("trainapp.tasks").joinpath("text/corpus.txt")
    try:
        data = (shipped if path is None else Path(path)).read_bytes()
    except OSError as e:
        raise ConfigError(f"task.args.text={path}: cannot read it ({e.__class__.__name__}: {e})") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Blocks(torch.utils.data.Dataset):
    """Items of `block` tokens every `stride` tokens of `ids`: `input_ids`, and `labels` equal to them
    (a Hugging Face causal LM shifts the labels itself)."""

    def __init__(self, ids: torch.Tensor, block: int, stride: int):
        self.ids, self.block, self.stride = ids, block, stride
        self.n = max(0, (len(ids) - block) // stride + 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.ids[i * self.stride:i * self.stride + self.block].long()
        return {"input_ids": chunk, "labels": chunk}


def hf_config(arch: str, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
    """The `transformers` config of a small model over the byte vocabulary (no special tokens: a GPT-2
    config's default ones are outside 256 values; the loss named, as transformers asks)."""
    from transformers import GPT2Config, LlamaConfig  # imported where used: trainapp does not need it

    common = {"vocab_size": VOCAB, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
              "loss_type": "ForCausalLM"}
    if arch == "gpt2":
        return GPT2Config(n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                          resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **common)
    return LlamaConfig(hidden_size=n_embd, intermediate_size=4 * n_embd, num_hidden_layers=n_layer,
                       num_attention_heads=n_head, num_key_value_heads=n_head,
                       max_position_embeddings=block_size, attention_dropout=dropout, **common)


class CausalLM:
    """Next-byte prediction with a `transformers` causal LM: the first `1 - val_fraction` of the text
    trains (a block every `stride` bytes), the rest validates (blocks side by side). `arch`: `gpt2`
    (tied input and output embeddings) or `llama` (untied, rotary positions)."""

    random_items = False  # blocks of a fixed text: nothing random in reading one

    def __init__(self, arch: str = "gpt2", text: str | None = None, block_size: int = 64, stride: int = 32,
                 val_fraction: float = 0.05, n_layer: int = 2, n_head: int = 4, n_embd: int = 64,
                 dropout: float = 0.0):
        if arch not in ARCHS:
            raise ValueError(f"arch={arch!r}: use one of {', '.join(ARCHS)}")
        if n_layer < 1 or n_head < 1 or n_embd % n_head:
            raise ValueError(f"n_layer={n_layer} and n_head={n_head} must be >= 1 and n_embd={n_embd} a "
                             "multiple of n_head")
        if block_size < 2 or stride < 1 or not 0 < val_fraction < 1:
            raise ValueError(f"block_size={block_size} must be >= 2, stride={stride} >= 1 and "
                             f"val_fraction={val_fraction} between 0 and 1")
        self.arch, self.text, self.block = arch, text, block_size
        self.stride, self.val_fraction = stride, val_fraction
        self.shape = (n_layer, n_head, n_embd, dropout)

    # --- required: data, model, loss, evaluation ---------------------------------------------------

    def datasets(self, ctx):
        ids = read_bytes(self.text)
        cut = int(len(ids) * (1 - self.val_fraction))
        train, val = Blocks(ids[:cut], self.block, self.stride), Blocks(ids[cut:], self.block, self.block)
        if len(val) == 0:
            raise ConfigError(f"task.args.text={self.text}: {len(ids)} bytes are too few for a validation "
                              f"block of block_size={self.block}; use a longer text or a larger val_fraction")
        return train, val

    def model(self, ctx) -> nn.Module:
        """Built from the config (torch seeded by trainapp: the same weights on every rank). The config's
        `use_cache` stays on for whoever generates with the export; `loss` and `evaluate` turn it off."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hf_config(self.arch, self.block, *self.shape))
        model.loss_type = "ForCausalLM"  # transformers 5 finds no loss in the name GPT2LMHeadModel (it warns)
        return model

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's own loss (`labels=`: mean cross entropy of each next token)."""
        return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss

    def evaluate(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The summed cross entropy of every predicted token (all but each block's first), in nats."""
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        target = batch["labels"][:, 1:]
        nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), target.flatten(), reduction="sum")
        return {"loss": nll, "count": target.numel()}

    # --- optional ---------------------------------------------------------------------------------

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """FSDP units (parallel.strategy=fsdp): the transformer blocks."""
        return list(model.transformer.h if self.arch == "gpt2" else model.model.layers)

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """Hugging Face's format beside trainapp's file: `out_dir/hf/` (config.json, model.safetensors,
        generation_config.json), which `AutoModelForCausalLM.from_pretrained` loads."""
        from transformers.utils import logging as hf_logging

        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no progress bar in the run's log
        try:
            model.save_pretrained(out_dir / "hf", safe_serialization=True)
        finally:
            if shown:
                hf_logging.enable_progress_bar()
