"""Typed run configuration: model family + dimensions, parallel layout, device, dtype.

Configs are keyword-only dataclasses loaded from YAML (`configs/*.yaml`) and overridden with
`key=value` strings (`parallel.tp=2`, `model.dtype=float64`). Every field is validated where it is
declared; errors name the offending value and what would be valid. Nothing here imports Megatron,
so a bad config fails in milliseconds, before any process group, allocation or write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

import yaml


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it and what would be valid."""


DTYPES = ("float32", "float64", "bfloat16", "float16")
RUN_DTYPES = ("float32", "float64", "bfloat16")
DEVICES = ("cpu", "cuda", "auto")
FAMILIES = ("qwen3_5", "glm_dsa")


class _ModelCommon:
    """What every family's model config derives the same way from `vocab_size`,
    `make_vocab_size_divisible_by` and `dtype` (no fields of its own)."""

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's rule: the smallest multiple of make_vocab_size_divisible_by * tp >= vocab_size."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[self.dtype]


@dataclass(kw_only=True)
class ModelConfig(_ModelCommon):
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
    attention_block: int = 1024
    """Key block of the blockwise attention (memory O(queries x block), never queries x keys)."""
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    """Parameter and activation dtype. `float16` only describes checkpoints (conversion keeps it);
    runs refuse it (no loss scaling here): pass model.dtype=bfloat16 or float32 to cast on load."""
    make_vocab_size_divisible_by: int = 1
    """Pad the vocabulary (embedding and output rows) to a multiple of this x tp, as Megatron does;
    padded entries never reach a log-prob. 1: pad only what tensor parallelism needs (Megatron's
    training default is 128, which configs/qwen3.6-27b.yaml sets)."""

    def __post_init__(self) -> None:
        _check_choice("model.family", self.family, ("qwen3_5",))
        _check_choice("model.dtype", self.dtype, DTYPES)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "full_attention_interval",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim", "gdn_chunk_size", "attention_block", "make_vocab_size_divisible_by"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model.{name}={v!r}: must be a positive integer")
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

    def check_layout(self, p: "ParallelConfig") -> None:
        validate_layout(self, p)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_types(self) -> list[str]:
        """Per layer (0-based): `linear_attention` (GDN) or `full_attention`, as Hugging Face names them."""
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_layers)]

    @property
    def state_dtype(self):
        """dtype of the GDN decay and recurrent state: at least float32."""
        import torch

        return torch.float64 if self.dtype == "float64" else torch.float32


@dataclass(kw_only=True)
class GlmDsaConfig(_ModelCommon):
    """Dimensions of a GLM-5.x decoder (`GlmMoeDsaForCausalLM`): MLA attention with DeepSeek Sparse
    Attention (an indexer picks `index_topk` keys per query; IndexShare: "shared" layers reuse the
    previous "full" layer's choice), a dense SwiGLU MLP on the first `first_k_dense_replace` layers and
    a sigmoid-routed MoE with a shared expert on the rest (models/glm5.py, models/glm_moe.py)."""

    family: Literal["glm_dsa"] = "glm_dsa"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Dense-layer SwiGLU inner size."""
    num_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    """The MLA latent kept per prompt position (with the RoPE key)."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: list[str] | None = None
    """Per layer: "full" (runs the indexer) or "shared" (reuses the previous full layer's top-k).
    None: from the IndexShare schedule below, as transformers derives it."""
    index_topk_freq: int = 1
    """IndexShare: every `freq`-th layer past the offset runs its indexer (GLM-5.2: 4; 1 = every layer)."""
    index_skip_topk_offset: int = 2
    """IndexShare: the layers before it all run their indexer (GLM-5.2: 3)."""
    first_k_dense_replace: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    moe_intermediate_size: int
    routed_scaling_factor: float = 2.5
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    attention_block: int = 1024
    index_block: int = 4096
    """Keys scored per block by the indexer (a running top-k between blocks): its scores take
    queries x (index_topk + index_block) values instead of queries x keys."""
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    make_vocab_size_divisible_by: int = 1

    def __post_init__(self) -> None:
        _check_choice("model.family", self.family, ("glm_dsa",))
        _check_choice("model.dtype", self.dtype, DTYPES)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                     "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "attention_block", "index_block", "make_vocab_size_divisible_by"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model.{name}={v!r}: must be a positive integer")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ConfigError(f"model.first_k_dense_replace={self.first_k_dense_replace}: must be in "
                              f"[0, model.num_layers={self.num_layers}]")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds model.n_routed_experts="
                              f"{self.n_routed_experts}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim}: must be even and at most "
                              f"model.index_head_dim={self.index_head_dim} (the indexer rotates that many dims)")
        if self.indexer_types is None:
            if self.index_topk_freq < 1 or self.index_skip_topk_offset < 0:
                raise ConfigError(f"model.index_topk_freq={self.index_topk_freq}, model.index_skip_topk_offset="
                                  f"{self.index_skip_topk_offset}: need freq >= 1 and offset >= 0")
            self.indexer_types = self.index_share_schedule(self.num_layers, self.index_topk_freq,
                                                           self.index_skip_topk_offset)
        types = list(self.indexer_types)
        if len(types) != self.num_layers or any(t not in ("full", "shared") for t in types) or \
                (types and types[0] != "full"):
            raise ConfigError(f"model.indexer_types={types}: need {self.num_layers} entries of 'full'/'shared', the "
                              "first 'full' (a shared layer reuses the previous full layer's top-k)")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta}, model.rms_norm_eps={self.rms_norm_eps}: "
                              "both must be positive")

    @staticmethod
    def index_share_schedule(num_layers: int, freq: int = 1, offset: int = 2) -> list[str]:
        """GLM's IndexShare schedule from `index_topk_freq` / `index_skip_topk_offset` (as transformers
        derives it): layer i is full when max(i - offset + 1, 0) is a multiple of freq. GLM-5.2
        (freq 4, offset 3): full on 0, 1, 2, 6, 10, ..., 74 (21 of 78)."""
        freq = max(freq, 1)
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]

    @property
    def layer_types(self) -> list[str]:
        """Per layer (0-based): `mla_dsa_full` (runs its indexer) or `mla_dsa_shared`."""
        return [f"mla_dsa_{t}" for t in self.indexer_types]

    def check_layout(self, p: "ParallelConfig") -> None:
        """What this family runs at today, refused with the value before any allocation."""
        if self.num_attention_heads % p.tp:
            raise ConfigError(f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"parallel.tp={p.tp}")
        if self.n_routed_experts % p.ep:
            valid = [e for e in range(1, self.n_routed_experts + 1) if self.n_routed_experts % e == 0 and e <= 64]
            raise ConfigError(f"model.n_routed_experts={self.n_routed_experts} is not divisible by parallel.ep={p.ep}; "
                              f"expert parallel sizes that divide it: {valid}")
        if self.num_layers < p.pp:
            raise ConfigError(f"parallel.pp={p.pp} exceeds model.num_layers={self.num_layers}")
        stages = p.stage_layers(self.num_layers)
        starts = [sum(stages[:s]) for s in range(1, len(stages))]
        bad = [i for i in starts if self.indexer_types[i] != "full"]
        if bad:  # IndexShare stays inside a stage: a shared layer reads the top-k of a full layer before it
            full = [i for i, t in enumerate(self.indexer_types) if t == "full" and i > 0]
            raise ConfigError(f"parallel.pp_layers={stages}: stage(s) would start at layer(s) {bad}, which reuse the "
                              f"previous layer's top-k (IndexShare 'shared'); a stage must start at a full indexer "
                              f"layer: one of {full[:12]}{' ...' if len(full) > 12 else ''}")

    def describe(self) -> str:
        """One line of what the layers are, for logs."""
        t, k = self.indexer_types, self.mlp_types
        return (f"{self.num_layers} MLA/DSA layers ({t.count('full')} full indexer + {t.count('shared')} shared; "
                f"{k.count('dense')} dense + {k.count('moe')} MoE of {self.n_routed_experts} experts, top "
                f"{self.num_experts_per_tok}), hidden {self.hidden_size}")

    @property
    def mlp_types(self) -> list[str]:
        return ["dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_layers)]


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout. Data parallelism is whatever remains of the world size."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    cp: int = 1
    """Context parallel size: the prompt and its state sharded by sequence (zig-zag pieces of every
    capture chunk), branches replayed whole on every CP rank (prompt_state/contexts.py)."""
    ep: int = 1
    """Expert parallel size (MoE families only)."""
    pp_layers: list[int] | None = None
    """Decoder layers of each pipeline stage, first to last (uneven stages, e.g. [15, 16, 16, 17] for
    64 layers at pp=4); None splits them evenly. The embedding sits on the first stage and the output
    layer on the last (both families keep them untied)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{name}={v!r}: must be a positive integer")
        if self.pp_layers is not None:
            pl = self.pp_layers
            if not isinstance(pl, (list, tuple)) or any(not isinstance(n, int) or isinstance(n, bool) or n < 1
                                                         for n in pl):
                raise ConfigError(f"parallel.pp_layers={pl!r}: must be a list of positive layer counts, one per "
                                  f"pipeline stage")
            if len(pl) != self.pp:
                raise ConfigError(f"parallel.pp_layers={list(pl)} has {len(pl)} stages but parallel.pp={self.pp}; "
                                  f"give one layer count per stage")
            self.pp_layers = list(pl)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage; raises ConfigError when they do not add up."""
        if self.pp_layers is not None:
            if sum(self.pp_layers) != num_layers:
                raise ConfigError(f"parallel.pp_layers={self.pp_layers} adds up to {sum(self.pp_layers)} layers but "
                                  f"model.num_layers={num_layers}")
            return list(self.pp_layers)
        if num_layers % self.pp:
            raise ConfigError(f"model.num_layers={num_layers} is not divisible by parallel.pp={self.pp}; set "
                              f"parallel.pp_layers (a layer count per stage, adding up to {num_layers})")
        return [num_layers // self.pp] * self.pp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def dp_for(self, world_size: int) -> int:
        mp = self.model_parallel_size
        if world_size % mp:
            raise ConfigError(f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp}"
                              f" = {mp}; launch a multiple of {mp} ranks or change parallel.*")
        dp = world_size // mp
        if (self.tp * self.cp * dp) % self.ep:  # Megatron draws the EP groups from a stage's tp x cp x dp ranks
            raise ConfigError(f"parallel.ep={self.ep} does not divide the {self.tp * self.cp * dp} ranks of a pipeline "
                              f"stage (tp*cp*dp = {self.tp}*{self.cp}*{dp} at world size {world_size}); launch more "
                              f"ranks or use a smaller parallel.ep")
        return dp


@dataclass(kw_only=True)
class ReplayConfig:
    """Branch replay (ARCHITECTURE.md sections 1-2)."""

    mode: Literal["detached", "exact"] = "detached"
    """detached: prompt state held constant (LongStraw's truncated gradient); exact: full-sequence GRPO."""
    chunk_len: int = 4096
    """Capture chunk length (tokens); peak capture activations are one chunk."""
    logprob_chunk: int = 1024
    """Tokens per vocab-parallel log-softmax chunk."""
    batch_branches: bool = False
    """Replay all branches of a group as one right-padded batch instead of one at a time."""
    attn_probs_budget_mib: float = 0.0
    """A replayed branch keeps its attention probabilities over the prompt for the backward (no score
    recompute: the FLOP minimum) when they fit in this many MiB per rank, summed over this rank's
    attention layers (layers x local heads x branch tokens x prompt tokens x 4 B, 8 B in float64);
    otherwise, and at 0 (default), the backward recomputes them (memory O(branch x block))."""

    def __post_init__(self):
        _check_choice("replay.mode", self.mode, ("detached", "exact"))
        if not self.attn_probs_budget_mib >= 0:
            raise ConfigError(f"replay.attn_probs_budget_mib={self.attn_probs_budget_mib}: must be >= 0 "
                              "(0 = always recompute)")
        if self.chunk_len < 1 or self.logprob_chunk < 1:
            raise ConfigError(f"replay.chunk_len={self.chunk_len}, replay.logprob_chunk={self.logprob_chunk}: "
                              "must be >= 1")


@dataclass(kw_only=True)
class GRPOConfig:
    """The GRPO objective (ARCHITECTURE.md section 2); defaults are what a run gets unconfigured."""

    objective: Literal["grpo", "dpo"] = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    """GRPO: weight of the k3 KL penalty to the reference policy. DPO: the DPO temperature."""
    std_normalize: bool = True
    """Divide advantages by the group's reward std (torch.std, unbiased); False: mean-only."""
    adv_eps: float = 1e-6
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"

    def __post_init__(self):
        _check_choice("grpo.objective", self.objective, ("grpo", "dpo"))
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ConfigError(f"grpo.eps_low={self.eps_low}, grpo.eps_high={self.eps_high}: need 0 <= eps_low < 1, "
                              "eps_high >= 0")
        if self.beta < 0:
            raise ConfigError(f"grpo.beta={self.beta}: must be >= 0")
        _check_choice("grpo.aggregation", self.aggregation, ("token_mean", "seq_mean"))


@dataclass(kw_only=True)
class RolloutConfig:
    """On-policy sampling from the captured prompt state (`longstraw rollout`, `train --online`)."""

    temperature: float = 1.0
    """0: greedy (ties to the lowest id); > 0: softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p."""
    max_tokens: int = 32
    stop_ids: list[int] = field(default_factory=list)
    """A branch ends after sampling any of these (the stop token is kept in the response)."""
    group_size: int = 8
    seed: int = 0
    """Every rank draws the same numbers for (seed, prompt index, step): layouts sample the same tokens."""
    max_prompt_len: int = 1 << 22
    """Prompts longer than this are refused before any model work."""

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ConfigError(f"rollout.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p}: must be in (0, 1]")
        for name in ("max_tokens", "group_size", "max_prompt_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"rollout.{name}={v!r}: must be an integer >= 1")
        if not isinstance(self.stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                          for t in self.stop_ids):
            raise ConfigError(f"rollout.stop_ids={self.stop_ids!r}: must be a list of token ids (integers >= 0)")


@dataclass(kw_only=True)
class OpsConfig:
    """Which kernel each op runs (ops/dispatch.py)."""

    attention: Literal["auto", "plain", "flash"] = "auto"
    """auto: torch's flash ops for CUDA bf16/fp16, the plain-torch twin otherwise; plain / flash force one
    (flash errors where it cannot run)."""
    gdn: Literal["auto", "plain", "fla"] = "auto"
    """Gated DeltaNet: auto takes flash-linear-attention for CUDA bf16/fp16 where installed (the gpu extra),
    the plain-torch chunked rule otherwise; plain / fla force one."""

    def __post_init__(self):
        _check_choice("ops.attention", self.attention, ("auto", "plain", "flash"))
        _check_choice("ops.gdn", self.gdn, ("auto", "plain", "fla"))


@dataclass(kw_only=True)
class TaskConfig:
    """The built-in task `train --online` and `longstraw rollout --task-prompts` draw prompts from and score
    (tasks/key_recall.py holds the task itself)."""

    name: Literal["key_recall"] = "key_recall"
    min_len: int = 64
    max_len: int = 256
    """Prompt lengths (uniform in [min_len, max_len]): the held-out prompts, and training once any curriculum ends."""
    key_len: int = 2
    n_values: int = 16
    copies: int = 1
    """How many times the key appears in a prompt (at independent random positions)."""
    start_len: list[int] = field(default_factory=list)
    """Length curriculum: [min, max] of the training prompts for the first `hold_steps` steps, then both
    grow geometrically to [min_len, max_len] over `ramp_steps` steps; [] (default): no curriculum."""
    hold_steps: int = 0
    ramp_steps: int = 0
    seed: int = 0
    eval_prompts: int = 32
    """Held-out prompts (greedy decoding, split over data-parallel ranks) scored every `eval_every` steps; 0: none."""
    eval_every: int = 5

    def __post_init__(self):
        _check_choice("task.name", self.name, ("key_recall",))
        for name in ("eval_prompts", "eval_every", "hold_steps", "ramp_steps", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"task.{name}={v!r}: must be an integer >= 0")
        if not isinstance(self.key_len, int) or not 1 <= self.key_len <= 16:
            raise ConfigError(f"task.key_len={self.key_len!r}: must be an integer in 1..16")
        if not isinstance(self.n_values, int) or self.n_values < 2:
            raise ConfigError(f"task.n_values={self.n_values!r}: must be an integer >= 2")
        if not isinstance(self.copies, int) or self.copies < 1:
            raise ConfigError(f"task.copies={self.copies!r}: must be an integer >= 1")
        shortest = self.copies * self.key_len + 8  # room for the key copies, some distractors and the marker
        if not (isinstance(self.min_len, int) and isinstance(self.max_len, int)
                and shortest <= self.min_len <= self.max_len):
            raise ConfigError(f"task.min_len={self.min_len!r}, task.max_len={self.max_len!r}: need "
                              f"{shortest} <= min_len <= max_len ({shortest} = task.copies * task.key_len + 8)")
        if self.start_len:
            s = self.start_len
            if not (len(s) == 2 and all(isinstance(x, int) for x in s) and shortest <= s[0] <= s[1]
                    and s[0] <= self.min_len and s[1] <= self.max_len):
                raise ConfigError(f"task.start_len={s!r}: must be [min, max] with {shortest} <= min <= max, "
                                  f"min <= task.min_len={self.min_len} and max <= task.max_len={self.max_len}")
        elif self.hold_steps or self.ramp_steps:
            raise ConfigError(f"task.hold_steps={self.hold_steps}, task.ramp_steps={self.ramp_steps} without "
                              "task.start_len: give the curriculum's starting lengths [min, max], or set both to 0")

    def lengths(self, step: int) -> tuple[int, int]:
        """[min, max] of the training prompts at optimizer step `step` (1-based)."""
        if not self.start_len:
            return self.min_len, self.max_len
        frac = min(1.0, max(0, step - self.hold_steps) / self.ramp_steps) if self.ramp_steps else float(
            step > self.hold_steps)
        lo, hi = (round(a * (b / a) ** frac) for a, b in zip(self.start_len, (self.min_len, self.max_len)))
        return lo, max(lo, hi)

    def check_vocab(self, vocab_size: int) -> None:
        need = 2 + self.n_values + 8  # token 0 unused, the marker, the values, at least 8 distractors
        if vocab_size < need:
            raise ConfigError(f"model.vocab_size={vocab_size} is too small for key recall with task.n_values="
                              f"{self.n_values} (needs >= {need})")


@dataclass(kw_only=True)
class TrainConfig:
    """Optimizer and loop of `longstraw train`; a step is counted in prompt groups."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    groups_per_step: int = 1
    """Prompt groups per optimizer step on each data-parallel rank."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer (Adam state sharded over data parallel)."""
    save_every: int = 0
    """Checkpoint every K steps (0: only at the end when --save is given)."""
    grad_reduction: Literal["step", "micro_step"] = "step"
    """`step`: Megatron DDP (a full-size gradient buffer per rank, reduced once per step) and Megatron's
    optimizer. `micro_step`: every micro-step's gradients reduce-scattered over data x context
    parallel ranks as autograd produces them and kept as float32 shards (ZeRO-2; train/zero2.py),
    AdamW on the shards: no rank holds a full-size gradient between micro-steps."""

    def __post_init__(self):
        _check_choice("train.grad_reduction", self.grad_reduction, ("step", "micro_step"))
        if self.lr <= 0 or self.groups_per_step < 1 or self.save_every < 0 or self.clip_grad < 0:
            raise ConfigError(f"train.lr={self.lr}, train.groups_per_step={self.groups_per_step}, "
                              f"train.save_every={self.save_every}, train.clip_grad={self.clip_grad}: need lr > 0, "
                              "groups_per_step >= 1, save_every >= 0, clip_grad >= 0")


@dataclass(kw_only=True)
class RunConfig:
    """Everything one `longstraw` invocation needs."""

    model: ModelConfig | GlmDsaConfig
    """The model; its `family` key picks the dataclass (qwen3_5 when absent)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """`cpu` (gloo), `cuda` (NCCL), or `auto`: cuda when available."""
    seed: int = 1234

    def __post_init__(self) -> None:
        _check_choice("device", self.device, DEVICES)
        self.model.check_layout(self.parallel)
        bad = [t for t in self.rollout.stop_ids if t >= self.model.vocab_size]
        if bad:
            raise ConfigError(f"rollout.stop_ids={self.rollout.stop_ids}: {bad} not below model.vocab_size="
                              f"{self.model.vocab_size}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def validate_layout(m: ModelConfig | GlmDsaConfig, p: ParallelConfig) -> None:
    """Check that the model splits over the layout; errors name both numbers."""
    if not isinstance(m, ModelConfig):
        return m.check_layout(p)
    tp = p.tp
    checks = [
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.linear_num_key_heads", m.linear_num_key_heads),
        ("model.linear_num_value_heads", m.linear_num_value_heads),
        ("model.intermediate_size", m.intermediate_size),
    ]  # the vocabulary is padded to what TP needs (model.make_vocab_size_divisible_by)
    for name, v in checks:
        if v % tp:
            valid = [d for d in range(1, v + 1) if v % d == 0 and d <= 64]
            raise ConfigError(f"{name}={v} is not divisible by parallel.tp={tp}; tensor parallel sizes that divide "
                              f"it: {valid}")
    hk = m.num_key_value_heads
    if tp > hk and tp % hk == 0:  # KV groups: each KV head's state sharded over tp/hk ranks (parallel/kv_group.py)
        if p.cp > 1:
            raise ConfigError(f"parallel.tp={tp} exceeds model.num_key_value_heads={hk} (KV groups) together with "
                              f"parallel.cp={p.cp}: not supported yet; use parallel.tp <= {hk} with context parallelism")
    elif hk % tp:
        valid = [d for d in range(1, 65) if m.num_attention_heads % d == 0 and (hk % d == 0 or d % hk == 0)]
        raise ConfigError(f"model.num_key_value_heads={hk} is not divisible by parallel.tp={tp}, nor is tp a multiple "
                          f"of it; tensor parallel sizes that fit: {valid}")
    if m.num_layers < p.pp:
        raise ConfigError(f"parallel.pp={p.pp} exceeds model.num_layers={m.num_layers}")
    p.stage_layers(m.num_layers)
    if p.ep != 1:
        raise ConfigError(f"parallel.ep={p.ep}: the {m.family} family has no experts; use parallel.ep=1")
    if p.cp > 1:  # Gated DeltaNet runs on 1/(tp*cp) of its heads during capture (prompt_state/contexts.py)
        for name, v in (("model.linear_num_key_heads", m.linear_num_key_heads),
                        ("model.linear_num_value_heads", m.linear_num_value_heads)):
            if v % (tp * p.cp):
                valid = [c for c in range(1, v // tp + 1) if (v // tp) % c == 0]
                raise ConfigError(f"{name}={v} is not divisible by parallel.tp*parallel.cp={tp}*{p.cp}; context "
                                  f"parallel sizes that divide it at tp={tp}: {valid}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: must be one of {list(choices)}")


# ---------------------------------------------------------------------------------------------
# YAML + key=value overrides


def _dataclass_from_dict(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown config key(s) {[prefix + k for k in unknown]}; valid keys under "
                          f"{where or 'the top level'}: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        typ = hints[name]
        path = f"{where}.{name}" if where else name
        if typ == ModelConfig | GlmDsaConfig:
            kwargs[name] = model_config_from_dict(value, path)
        elif dataclasses.is_dataclass(typ):
            kwargs[name] = _dataclass_from_dict(typ, value, path)
        else:
            kwargs[name] = _coerce(typ, value, path)
    missing = [f.name for f in fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"missing required config key(s): {[prefix + k for k in missing]}")
    return cls(**kwargs)


def _coerce(typ, value, path: str):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{path}={value!r}: expected a number") from None
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if getattr(typ, "__origin__", None) is Literal:
        if value not in get_args(typ):
            raise ConfigError(f"{path}={value!r}: must be one of {list(get_args(typ))}")
        return value
    if typ in (int, float, str, bool) and not isinstance(value, typ):
        raise ConfigError(f"{path}={value!r}: expected {typ.__name__}")
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (value parsed as YAML) to a nested dict, copying it."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. parallel.tp=2")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> RunConfig:
    """Load `RunConfig` from a YAML file (or `base` dict), then apply `key=value` overrides."""
    data: dict = {}
    if base is not None:
        data = base
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        data = _deep_merge(data, loaded)
    data = apply_overrides(data, list(overrides))
    return _dataclass_from_dict(RunConfig, data, "")


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


MODEL_CONFIGS = {"qwen3_5": ModelConfig, "glm_dsa": GlmDsaConfig}


def model_config_from_dict(d: dict, where: str = "model") -> ModelConfig | GlmDsaConfig:
    """The family's model config (`family` picks it; qwen3_5 when absent)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    family = d.get("family", "qwen3_5")
    _check_choice(f"{where}.family", family, tuple(MODEL_CONFIGS))
    return _dataclass_from_dict(MODEL_CONFIGS[family], d, where)


__all__ = ["ConfigError", "ModelConfig", "GlmDsaConfig", "ParallelConfig", "ReplayConfig", "GRPOConfig", "TrainConfig", "RunConfig", "load_config", "apply_overrides",
           "validate_layout", "config_to_dict", "model_config_from_dict"]
