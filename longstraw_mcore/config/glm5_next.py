"""Dimensions of a GLM-5.3-Flash text decoder (`glm5_next` in transformers: Kimi Delta Attention layers
interleaved with MLA layers without RoPE whose DSA indexer picks pooled groups of tokens, dense then
routed-MoE MLPs, hyper-connection residual streams) and the layouts it runs at; `glm_5_3_flash()` builds
the published dimensions. No torch, no Megatron. docs/glm5-next-plan.md holds the design."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longstraw_mcore.config.errors import ConfigError, check_choices, check_ints
from longstraw_mcore.config.layout import ParallelConfig
from longstraw_mcore.config.model_base import DType, ModelBase


@dataclass(kw_only=True)
class Glm5NextConfig(ModelBase):
    """The text decoder of `Glm5NextForConditionalGeneration` (its vision tower is not run here).

    Layer i is Kimi Delta Attention (`mixer_types[i]` = linear_attention: a gated delta rule with a decay
    per key channel, ops/kda.py) or MLA + DSA (indexed_attention: no RoPE; the indexer scores pools of
    `index_kpool` tokens and keeps the best index_topk / index_kpool of them plus the query's incomplete
    pool). `indexer_types[i]` (over every layer, as transformers keeps it): an MLA layer is "full" (runs
    its indexer) or "shared" (reuses the selection of the MLA layer directly before it). Every sublayer
    is wrapped in `hc_mult` residual streams mixed by a Sinkhorn-normalised map (models/hyper_connection.py)."""

    family: Literal["glm5_next"] = "glm5_next"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Dense-layer SwiGLU inner size."""
    num_layers: int
    mixer_types: list[str] | None = None
    """Per layer: `linear_attention` (KDA) or `indexed_attention` (MLA + DSA), transformers' `layer_types`.
    None: every 4th layer (1-based) MLA, the others KDA, as transformers derives it."""
    indexer_types: list[str] | None = None
    """Per layer (KDA layers included, where it is unused): "full" or "shared". None: every layer full."""
    mlp_layer_types: list[str] | None = None
    """Per layer: "dense" or "sparse" (MoE). None: the first three dense, as transformers derives it."""
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    """The MLA latent kept per prompt position (there is no RoPE key)."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int = 0
    """Always 0: GLM-5.3-Flash's MLA has no RoPE (kept so the MLA code reads one set of names)."""
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    """Tokens a query may select (in index_topk / index_kpool whole pools), besides its incomplete pool."""
    index_kpool: int = 16
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    moe_intermediate_size: int
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0
    """SwiGLU clamp: gate <= limit, -limit <= up <= limit (dense, shared and routed experts)."""
    linear_num_heads: int
    """KDA heads (as many key heads as value heads)."""
    linear_head_dim: int
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    """KDA's forget gate: g = bound * sigmoid(...) in (bound, 0); None: -exp(A) softplus(...) (unbounded)."""
    hc_mult: int = 4
    """Residual streams per position."""
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    rms_norm_eps: float = 1e-5
    attention_block: int = 1024
    index_block: int = 4096
    """Pooled keys scored per block by the indexer (a running top-k between blocks)."""
    gdn_chunk_size: int = 64
    """Chunk length of the chunked KDA rule."""
    gdn_cp: Literal["auto", "heads", "sequence"] = "auto"
    """How KDA runs under context parallelism: as Qwen35Config.gdn_cp (the same two paths)."""
    dtype: DType = "float32"
    make_vocab_size_divisible_by: int = 1

    def __post_init__(self) -> None:
        check_choices(self, "model")
        check_ints(self, "model", (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
            "index_kpool", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "linear_num_heads",
            "linear_head_dim", "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters", "attention_block",
            "index_block", "gdn_chunk_size", "make_vocab_size_divisible_by"))
        n = self.num_layers
        if self.mixer_types is None:
            self.mixer_types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        self.mixer_types = ["indexed_attention" if t == "full_attention" else t for t in self.mixer_types]
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
        for name, allowed in (("mixer_types", ("linear_attention", "indexed_attention")),
                              ("indexer_types", ("full", "shared")), ("mlp_layer_types", ("dense", "sparse"))):
            v = list(getattr(self, name))
            if len(v) != n or any(t not in allowed for t in v):
                raise ConfigError(f"model.{name}={v}: need model.num_layers={n} entries, each one of {list(allowed)}")
        mla = [t == "indexed_attention" for t in self.mixer_types]
        full = [a and s == "full" for a, s in zip(mla, self.indexer_types)]
        bad = [i for i, s in enumerate(self.indexer_types) if s == "shared" and mla[i] and not (i > 0 and full[i - 1])]
        if bad:  # transformers hands a selection only from a full MLA layer to the layer right after it
            raise ConfigError(f"model.indexer_types: MLA layer(s) {bad} are 'shared' but the layer before each is not "
                              "a full MLA layer (a KDA layer hands on no selection); make them 'full'")
        if self.qk_rope_head_dim != 0:
            raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim}: GLM-5.3-Flash's MLA has no RoPE; use 0")
        if self.index_topk % self.index_kpool:
            raise ConfigError(f"model.index_topk={self.index_topk} is not a multiple of model.index_kpool="
                              f"{self.index_kpool}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds model.n_routed_experts="
                              f"{self.n_routed_experts}")
        if self.linear_lower_bound is not None and not self.linear_lower_bound < 0:
            raise ConfigError(f"model.linear_lower_bound={self.linear_lower_bound}: must be negative (or null)")
        if self.rms_norm_eps <= 0 or self.hc_eps < 0 or self.swiglu_limit <= 0:
            raise ConfigError(f"model.rms_norm_eps={self.rms_norm_eps}, hc_eps={self.hc_eps}, swiglu_limit="
                              f"{self.swiglu_limit}: need positive, non-negative, positive")

    @property
    def layer_types(self) -> list[str]:
        """Per layer (0-based), the family's layer kinds: `kda`, `mla_dsa_full` or `mla_dsa_shared`."""
        return ["kda" if t == "linear_attention" else f"mla_dsa_{s}"
                for t, s in zip(self.mixer_types, self.indexer_types)]

    @property
    def residual_streams(self) -> int:
        """The hyper-connection streams: the residual is hc_mult x hidden_size wide (ModelBase.residual_streams)."""
        return self.hc_mult

    @property
    def mlp_types(self) -> list[str]:
        """Per layer: "dense" or "moe" (GlmDsaConfig's words for transformers' dense / sparse)."""
        return ["moe" if t == "sparse" else "dense" for t in self.mlp_layer_types]

    # The Gated DeltaNet names the KDA state and its context-parallel paths read (H_k = H_v, one key head
    # per value head): prompt_state/gdn.py, parallel/cp_gdn.py
    @property
    def linear_num_key_heads(self) -> int:
        return self.linear_num_heads

    @property
    def linear_num_value_heads(self) -> int:
        return self.linear_num_heads

    @property
    def linear_key_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def linear_value_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def state_dtype(self):
        """dtype of the KDA decay and recurrent state: at least float32."""
        import torch

        return torch.float64 if self.dtype == "float64" else torch.float32

    @property
    def state_heads(self) -> int:
        """One MLA latent serves every head (prompt_state/mla.py stripes it over the TP group)."""
        return 1

    def check_layout(self, p: ParallelConfig) -> None:
        """What this family runs at, refused with the value before any allocation."""
        for name, v in (("model.num_attention_heads", self.num_attention_heads),
                        ("model.linear_num_heads", self.linear_num_heads)):
            if v % p.tp:
                valid = [d for d in range(1, min(v, 64) + 1) if v % d == 0]
                raise ConfigError(f"{name}={v} is not divisible by parallel.tp={p.tp}; tensor parallel sizes that "
                                  f"divide it: {valid}")
        if self.n_routed_experts % p.ep:
            valid = [e for e in range(1, min(self.n_routed_experts, 64) + 1) if self.n_routed_experts % e == 0]
            raise ConfigError(f"model.n_routed_experts={self.n_routed_experts} is not divisible by parallel.ep={p.ep}; "
                              f"expert parallel sizes that divide it: {valid}")
        if self.num_layers < p.pp * p.vpp:
            raise ConfigError(f"parallel.pp={p.pp}" + (f" x parallel.vpp={p.vpp}" if p.vpp > 1 else "")
                              + f" exceeds model.num_layers={self.num_layers}")
        stages = p.virtual_stage_layers(self.num_layers)
        starts = [sum(stages[:s]) for s in range(1, len(stages))]
        bad = [i for i in starts if self.layer_types[i] == "mla_dsa_shared"]
        if bad:  # a shared layer reads the selection of the layer before it, on its own stage
            raise ConfigError(f"parallel.pp_layers={stages}: {'virtual ' if p.vpp > 1 else ''}stage(s) would start at "
                              f"layer(s) {bad}, which reuse the previous layer's selection (indexer 'shared'); move "
                              "the stage boundary")
        if p.cp > 1 and self.gdn_cp == "heads" and (self.linear_num_heads // p.tp) % p.cp:
            raise ConfigError(f"model.gdn_cp=heads: model.linear_num_heads={self.linear_num_heads} is not divisible by "
                              f"parallel.tp*parallel.cp={p.tp}*{p.cp} (or model.gdn_cp=sequence / auto: any cp)")

    def describe(self) -> str:
        """One line of what the layers are, for logs."""
        t, k = self.layer_types, self.mlp_types
        return (f"{self.num_layers} layers ({t.count('kda')} KDA + {t.count('mla_dsa_full')} full / "
                f"{t.count('mla_dsa_shared')} shared MLA-DSA; {k.count('dense')} dense + {k.count('moe')} MoE of "
                f"{self.n_routed_experts} experts, top {self.num_experts_per_tok}; {self.hc_mult} streams), "
                f"hidden {self.hidden_size}")

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Every projection an adapter may target, by its Hugging Face module name: (out, in); a name that
        ends several modules (o_proj: KDA's and MLA's; gate_proj: dense, shared, routed) gets the smallest."""
        H, nh, R, Q = self.hidden_size, self.num_attention_heads, self.kv_lora_rank, self.q_lora_rank
        Dn, Dv, D, K = self.qk_nope_head_dim, self.v_head_dim, self.linear_num_heads * self.linear_head_dim, \
            self.linear_head_dim
        inner = [self.intermediate_size] if "dense" in self.mlp_layer_types else []
        if "sparse" in self.mlp_layer_types:
            inner += [self.moe_intermediate_size] + ([self.moe_intermediate_size * self.n_shared_experts]
                                                     if self.n_shared_experts else [])
        Fm = min(inner)
        return {"q_a_proj": (Q, H), "q_b_proj": (nh * Dn, Q), "kv_a_proj_with_mqa": (R, H),
                "kv_b_proj": (nh * (Dn + Dv), R), "o_proj": (H, min(nh * Dv, D)),
                "q_proj": (D, H), "k_proj": (D, H), "v_proj": (D, H), "b_proj": (self.linear_num_heads, H),
                "f_a_proj": (K, H), "f_b_proj": (D, K), "g_a_proj": (K, H), "g_b_proj": (D, K),
                "gate_proj": (Fm, H), "up_proj": (Fm, H), "down_proj": (H, Fm), "lm_head": (self.vocab_size, H)}


def glm_5_3_flash(dtype: str = "bfloat16", **overrides) -> Glm5NextConfig:
    """GLM-5.3-Flash's dimensions as transformers 5.23's `Glm5NextTextConfig` defaults give them (its
    docstring names zai-org/GLM-5.3-Flash; the published config.json was not on hand to check): 45 layers
    (34 KDA + 11 MLA at 3, 7, ..., 43), hidden 4096, MLA 64 heads (q LoRA 1536, kv LoRA 512, no-RoPE 256,
    value 256), DSA 32 x 128 indexer heads, top 2048 in pools of 16, MoE from layer 3 (288 experts, top 8, one
    shared, 2048 wide), KDA 64 x 128 heads, 4 residual streams."""
    base = dict(vocab_size=154880, hidden_size=4096, intermediate_size=12288, num_layers=45, num_attention_heads=64,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, index_n_heads=32,
                index_head_dim=128, index_topk=2048, index_kpool=16, n_routed_experts=288, num_experts_per_tok=8,
                n_shared_experts=1, moe_intermediate_size=2048, routed_scaling_factor=2.5, swiglu_limit=10.0,
                linear_num_heads=64, linear_head_dim=128, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
                hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, rms_norm_eps=1e-5, dtype=dtype,
                make_vocab_size_divisible_by=128)
    base.update(overrides)
    return Glm5NextConfig(**base)
