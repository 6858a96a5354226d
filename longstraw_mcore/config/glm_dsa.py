"""Dimensions of a GLM-5.x decoder (`GlmMoeDsaForCausalLM`: MLA + DeepSeek Sparse Attention with
IndexShare, dense then MoE layers) and the layouts it runs at; `glm_5_2()` builds GLM-5.2's real
dimensions. No torch, no Megatron."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longstraw_mcore.config.errors import ConfigError, check_choices, check_ints
from longstraw_mcore.config.layout import ParallelConfig
from longstraw_mcore.config.model_base import DType, ModelBase


@dataclass(kw_only=True)
class GlmDsaConfig(ModelBase):
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
    dtype: DType = "float32"
    make_vocab_size_divisible_by: int = 1

    def architecture(self) -> dict:
        """ModelBase.architecture with the IndexShare schedule as the layers' indexer types (the
        frequency and offset only derive them when a config gives no list)."""
        out = super().architecture()
        del out["index_topk_freq"], out["index_skip_topk_offset"]
        return out

    def __post_init__(self) -> None:
        check_choices(self, "model")
        check_ints(self, "model", ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                                   "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                   "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                                   "num_experts_per_tok", "moe_intermediate_size", "attention_block", "index_block",
                                   "make_vocab_size_divisible_by"))
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

    def check_layout(self, p: ParallelConfig) -> None:
        """What this family runs at today, refused with the value before any allocation."""
        if self.num_attention_heads % p.tp:
            raise ConfigError(f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"parallel.tp={p.tp}")
        if self.n_routed_experts % p.ep:
            valid = [e for e in range(1, self.n_routed_experts + 1) if self.n_routed_experts % e == 0 and e <= 64]
            raise ConfigError(f"model.n_routed_experts={self.n_routed_experts} is not divisible by parallel.ep={p.ep}; "
                              f"expert parallel sizes that divide it: {valid}")
        if self.num_layers < p.pp * p.vpp:
            raise ConfigError(f"parallel.pp={p.pp}" + (f" x parallel.vpp={p.vpp}" if p.vpp > 1 else "")
                              + f" exceeds model.num_layers={self.num_layers}")
        stages = p.virtual_stage_layers(self.num_layers)  # (at vpp > 1 each model chunk is a stage of its own)
        starts = [sum(stages[:s]) for s in range(1, len(stages))]
        bad = [i for i in starts if self.indexer_types[i] != "full"]
        if bad:  # IndexShare stays inside a stage: a shared layer reads the top-k of a full layer before it
            full = [i for i, t in enumerate(self.indexer_types) if t == "full" and i > 0]
            raise ConfigError(f"parallel.pp_layers={stages}: {'virtual ' if p.vpp > 1 else ''}stage(s) would start "
                              f"at layer(s) {bad}, which reuse the previous layer's top-k (IndexShare 'shared'); a "
                              f"stage must start at a full indexer layer: one of {full[:12]}"
                              f"{' ...' if len(full) > 12 else ''}")

    def describe(self) -> str:
        """One line of what the layers are, for logs."""
        t, k = self.indexer_types, self.mlp_types
        return (f"{self.num_layers} MLA/DSA layers ({t.count('full')} full indexer + {t.count('shared')} shared; "
                f"{k.count('dense')} dense + {k.count('moe')} MoE of {self.n_routed_experts} experts, top "
                f"{self.num_experts_per_tok}), hidden {self.hidden_size}")

    @property
    def state_heads(self) -> int:
        """One latent serves every head: under tensor parallelism the whole TP group shares it (one KV
        group, the state striped over it by sequence: prompt_state/mla.py)."""
        return 1

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Every projection an adapter may target, by its Hugging Face module name: (out, in). A name
        covers each module it ends (gate_proj: the dense MLPs', the shared and the routed experts'), so
        its shape here is the smallest of them (the one the adapter rank must fit)."""
        H, nh, R = self.hidden_size, self.num_attention_heads, self.kv_lora_rank
        Dn, Dr, Dv = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        inner = [self.intermediate_size] if self.first_k_dense_replace else []
        if self.first_k_dense_replace < self.num_layers:
            inner += [self.moe_intermediate_size] + ([self.moe_intermediate_size * self.n_shared_experts]
                                                     if self.n_shared_experts else [])
        Fm = min(inner)
        return {"q_a_proj": (self.q_lora_rank, H), "q_b_proj": (nh * (Dn + Dr), self.q_lora_rank),
                "kv_a_proj_with_mqa": (R + Dr, H), "kv_b_proj": (nh * (Dn + Dv), R), "o_proj": (H, nh * Dv),
                "gate_proj": (Fm, H), "up_proj": (Fm, H), "down_proj": (H, Fm), "lm_head": (self.vocab_size, H)}

    @property
    def mlp_types(self) -> list[str]:
        return ["dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_layers)]


def glm_5_2(dtype: str = "bfloat16", **overrides):
    """GLM-5.2's real dimensions (zai-org's config.json as summarised in ../shared/notes/architectures.md
    section 3; transformers' GlmMoeDsaConfig for the IndexShare schedule): 78 layers, MLA (q LoRA 2048,
    kv LoRA 512, RoPE 64, no-RoPE 192, value 256, 64 heads), DSA (32 indexer heads of 128, top 2048,
    IndexShare every 4th layer after the first 3), MoE from layer 3 (256 experts, top 8, one shared)."""
    base = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_layers=78, num_attention_heads=64,
                q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                index_n_heads=32, index_head_dim=128, index_topk=2048,
                index_topk_freq=4, index_skip_topk_offset=3, first_k_dense_replace=3,
                n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                routed_scaling_factor=2.5, rope_theta=8_000_000.0, rms_norm_eps=1e-5, dtype=dtype,
                make_vocab_size_divisible_by=128)
    base.update(overrides)
    return GlmDsaConfig(**base)
