"""Dimensions of the Qwen3.5 / Qwen3.6 hybrid decoder (Gated DeltaNet + gated full attention) and the
layouts it splits over. No torch, no Megatron: a bad config fails in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longstraw_mcore.config.errors import ConfigError, check_choices, check_ints
from longstraw_mcore.config.layout import ParallelConfig
from longstraw_mcore.config.model_base import DType, ModelBase


@dataclass(kw_only=True)
class Qwen35Config(ModelBase):
    """Dimensions of a Qwen3.6-family hybrid decoder (Gated DeltaNet + gated attention)."""

    family: Literal["qwen3_5"] = "qwen3_5"
    """Model family; `qwen3_5` is the text decoder of Qwen3.5 / Qwen3.6 (`Qwen3_5ForCausalLM`)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """SwiGLU inner size."""
    num_layers: int
    full_attention_interval: int = 4
    """Every `interval`-th layer (1-based) is gated full attention, the others Gated DeltaNet."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.25
    """Fraction of `head_dim` that RoPE rotates."""
    rope_theta: float = 10_000_000.0
    linear_num_key_heads: int
    """Gated DeltaNet q/k heads."""
    linear_num_value_heads: int
    """Gated DeltaNet value heads; a multiple of `linear_num_key_heads`."""
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    gdn_chunk_size: int = 64
    """Chunk length of the chunked gated delta rule."""
    gdn_cp: Literal["auto", "heads", "sequence"] = "auto"
    """How Gated DeltaNet runs under context parallelism (parallel/cp.py gdn_by_heads): `heads`, each CP
    rank the whole chunk for 1/cp of the key heads (two all-to-alls per layer and chunk; the key heads
    per TP rank must divide by cp); `sequence`, each rank its own pieces with an affine scan over the
    ranks (parallel/cp_gdn.py: any cp, about twice the delta-rule work per token, a few small
    gathers); `auto`, heads where they divide, sequence otherwise (`plan --suggest` weighs both)."""
    attention_block: int = 1024
    """Key block of the blockwise attention (memory O(queries x block), never queries x keys)."""
    dtype: DType = "float32"
    """Parameter and activation dtype. `float16` only describes checkpoints (conversion keeps it);
    runs refuse it (no loss scaling here): pass model.dtype=bfloat16 or float32 to cast on load."""
    make_vocab_size_divisible_by: int = 1
    """Pad the vocabulary (embedding and output rows) to a multiple of this x tp, as Megatron does;
    padded entries never reach a log-prob. 1: pad only what tensor parallelism needs (Megatron's
    training default is 128, which configs/qwen3.6-27b.yaml sets)."""

    def __post_init__(self) -> None:
        check_choices(self, "model")
        check_ints(self, "model", ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                   "full_attention_interval", "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                   "linear_value_head_dim", "linear_conv_kernel_dim", "gdn_chunk_size",
                                   "attention_block", "make_vocab_size_divisible_by"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"model.num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"model.linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                              f"model.linear_num_key_heads={self.linear_num_key_heads}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"model.partial_rotary_factor={self.partial_rotary_factor}: must be in (0, 1]")
        rot = self.rotary_dim
        if rot % 2 or rot != self.head_dim * self.partial_rotary_factor:
            raise ConfigError(f"model.head_dim={self.head_dim} * partial_rotary_factor={self.partial_rotary_factor}"
                              f" = {self.head_dim * self.partial_rotary_factor}: must be an even integer")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta}, model.rms_norm_eps={self.rms_norm_eps}: "
                              "both must be positive")

    def describe(self) -> str:
        """One line of what the layers are, for logs."""
        t = self.layer_types
        return (f"{self.num_layers} layers ({t.count('linear_attention')} Gated DeltaNet + "
                f"{t.count('full_attention')} gated attention), hidden {self.hidden_size}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_types(self) -> list[str]:
        """Per layer (0-based): `linear_attention` (GDN) or `full_attention`, as Hugging Face names them."""
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_layers)]

    @property
    def state_heads(self) -> int:
        """Heads the attention state is split by under tensor parallelism; tp above them forms KV groups
        (parallel/kv_group.py)."""
        return self.num_key_value_heads

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Every projection an adapter may target, by its Hugging Face module name: (out, in)."""
        H, D, kd = self.hidden_size, self.head_dim, self.linear_num_key_heads * self.linear_key_head_dim
        vd, nv, F = self.linear_num_value_heads * self.linear_value_head_dim, self.linear_num_value_heads, \
            self.intermediate_size
        return {"q_proj": (self.num_attention_heads * D * 2, H), "k_proj": (self.num_key_value_heads * D, H),
                "v_proj": (self.num_key_value_heads * D, H), "o_proj": (H, self.num_attention_heads * D),
                "in_proj_qkv": (2 * kd + vd, H), "in_proj_z": (vd, H), "in_proj_b": (nv, H),
                "in_proj_a": (nv, H), "out_proj": (H, vd),
                "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F), "lm_head": (self.vocab_size, H)}

    @property
    def state_dtype(self):
        """dtype of the GDN decay and recurrent state: at least float32."""
        import torch

        return torch.float64 if self.dtype == "float64" else torch.float32

    def check_layout(self, p: ParallelConfig) -> None:
        """Check that the model splits over the layout; errors name both numbers."""
        tp = p.tp
        checks = [
            ("model.num_attention_heads", self.num_attention_heads),
            ("model.linear_num_key_heads", self.linear_num_key_heads),
            ("model.linear_num_value_heads", self.linear_num_value_heads),
            ("model.intermediate_size", self.intermediate_size),
        ]  # the vocabulary is padded to what TP needs (model.make_vocab_size_divisible_by)
        for name, v in checks:
            if v % tp:
                valid = [d for d in range(1, v + 1) if v % d == 0 and d <= 64]
                raise ConfigError(f"{name}={v} is not divisible by parallel.tp={tp}; tensor parallel sizes that "
                                  f"divide it: {valid}")
        hk = self.num_key_value_heads
        # tp > hk (a multiple): KV groups, each KV head's state sharded over tp/hk ranks (parallel/kv_group.py;
        # with context parallelism also over CP: group_cp_attention)
        if hk % tp and not (tp > hk and tp % hk == 0):
            valid = [d for d in range(1, 65) if self.num_attention_heads % d == 0 and (hk % d == 0 or d % hk == 0)]
            raise ConfigError(f"model.num_key_value_heads={hk} is not divisible by parallel.tp={tp}, nor is tp a "
                              f"multiple of it; tensor parallel sizes that fit: {valid}")
        if self.num_layers < p.pp:
            raise ConfigError(f"parallel.pp={p.pp} exceeds model.num_layers={self.num_layers}")
        p.stage_layers(self.num_layers)
        if p.ep != 1:
            raise ConfigError(f"parallel.ep={p.ep}: the {self.family} family has no experts; use parallel.ep=1")
        if p.cp > 1 and self.gdn_cp == "heads" and (self.linear_num_key_heads // tp) % p.cp:
            valid = [c for c in range(1, self.linear_num_key_heads // tp + 1) if (self.linear_num_key_heads // tp) % c == 0]
            raise ConfigError(f"model.gdn_cp=heads: model.linear_num_key_heads={self.linear_num_key_heads} is not "
                              f"divisible by parallel.tp*parallel.cp={tp}*{p.cp}; context parallel sizes that divide it "
                              f"at tp={tp}: {valid} (or model.gdn_cp=sequence / auto: any cp)")
