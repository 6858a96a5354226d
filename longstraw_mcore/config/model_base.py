"""What every model family's config derives the same way: the vocabulary padding, the torch dtype."""

from __future__ import annotations

from typing import Literal

DType = Literal["float32", "float64", "bfloat16", "float16"]
"""Parameter and activation dtypes a model config may name. `float16` only describes checkpoints
(conversion keeps it); runs refuse it (no loss scaling here)."""


class ModelBase:
    """Mixed into each family's model config (it has no fields of its own); needs `vocab_size`,
    `make_vocab_size_divisible_by` and `dtype`."""

    RUN_SETTINGS = ("dtype", "make_vocab_size_divisible_by", "attention_block", "gdn_chunk_size", "index_block",
                    "gdn_cp")
    """Fields that say how this run computes, not which model it is: a Hugging Face config.json does not
    hold them (read_config leaves their defaults), and two configs of one model may differ in them."""

    def architecture(self) -> dict:
        """The fields that define the model (its checkpoint's config.json), without RUN_SETTINGS."""
        import dataclasses

        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RUN_SETTINGS}

    @property
    def residual_streams(self) -> int:
        """Residual streams per position (a family with hyper-connections overrides it: Glm5NextConfig); the
        residual between layers and pipeline stages is that many times the hidden size wide."""
        return 1

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's rule: the smallest multiple of make_vocab_size_divisible_by * tp >= vocab_size."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[self.dtype]
