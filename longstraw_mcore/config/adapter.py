"""The `adapter` section: LoRA / QLoRA on the model's projections (adapters/), or full-parameter
training at `rank: 0`. Which projections a family has, and their shapes, are the family config's
(`projection_shapes`); this section checks its values against them (`check_against`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from longstraw_mcore.config.errors import ConfigError, check_choices


@dataclass(kw_only=True)
class AdapterConfig:
    """LoRA (Hu et al.) as Hugging Face PEFT defines it: y = W x + (alpha / rank) B A x, A [rank, in],
    B [out, rank], a new adapter starting at B = 0."""

    SECTION: ClassVar[str] = "adapter"
    rank: int = 0
    """0: full-parameter training (no adapter). > 0: only the adapters train; the base is frozen."""
    alpha: float = 16.0
    """PEFT's lora_alpha: the adapter's output is scaled by alpha / rank."""
    targets: list[str] | None = None
    """Hugging Face module names (`q_proj`, `in_proj_qkv`, `gate_proj`, ..., `lm_head`); None: every
    projection of the family (`projection_shapes`), lm_head excluded."""
    base_dtype: Literal["bfloat16", "nf4", "fp8"] = "bfloat16"
    """The frozen base's storage: the model's dtype (`bfloat16`: no quantization, whatever model.dtype
    is), torchao's NF4 (QLoRA) or float8 e4m3 with a float32 scale per block of 128, dequantized
    blockwise where a projection uses it."""
    prompt: Literal["adapted", "frozen"] = "adapted"
    """adapted: the adapters act at every position (the objective of a LoRA model run on prompt and
    response); frozen: at response positions only, so the captured prompt state does not depend on
    trainable weights (detached mode is then exact for that objective)."""

    def __post_init__(self):
        check_choices(self, self.SECTION)
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ConfigError(f"{self.SECTION}.rank={self.rank!r}: must be an integer >= 0 (0 = full-parameter training)")
        if self.rank and not self.alpha > 0:
            raise ConfigError(f"{self.SECTION}.alpha={self.alpha}: must be > 0")
        if self.targets is not None and (not self.targets or len(set(self.targets)) != len(self.targets)):
            raise ConfigError(f"{self.SECTION}.targets={self.targets}: a non-empty list of distinct module names "
                              "(or null for every projection)")
        if not self.rank and (self.base_dtype != "bfloat16" or self.prompt != "adapted"):
            raise ConfigError(f"{self.SECTION}.base_dtype={self.base_dtype!r}, {self.SECTION}.prompt={self.prompt!r} need "
                              f"{self.SECTION}.rank > 0 (full-parameter training has no frozen base)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def resolved_targets(self, shapes: dict[str, tuple[int, int]]) -> list[str]:
        """The target names, in the family's order (`shapes`: its projection_shapes())."""
        if self.targets is None:
            return [t for t in shapes if t != "lm_head"]
        return [t for t in shapes if t in self.targets]

    def check_against(self, shapes: dict[str, tuple[int, int]], family: str) -> None:
        """Every target is a projection of the family and rank fits each target's smaller dimension."""
        if not self.enabled:
            return
        unknown = [t for t in (self.targets or []) if t not in shapes]
        if unknown:
            raise ConfigError(f"{self.SECTION}.targets: {unknown} are not projections of the {family} family; valid: "
                              f"{list(shapes)}")
        for t in self.resolved_targets(shapes):
            if self.rank > min(shapes[t]):
                raise ConfigError(f"{self.SECTION}.rank={self.rank}: exceeds the smaller dimension {min(shapes[t])} of "
                                  f"{t} {list(shapes[t])} (out, in)")


@dataclass(kw_only=True)
class CriticAdapterConfig(AdapterConfig):
    """The `critic_adapter` section: LoRA / QLoRA on PPO's critic (grpo.objective=ppo), its own rank, alpha,
    targets, base storage and prompt rule, with the policy's `adapter` section's meanings. The critic's value
    head (`score`) trains whole beside its adapters, as PEFT's token-classification task keeps it
    (`modules_to_save`); lm_head is not a critic's. rank 0: the critic trains every parameter."""

    SECTION: ClassVar[str] = "critic_adapter"

    def __post_init__(self):
        super().__post_init__()
        if self.targets is not None and "lm_head" in self.targets:
            raise ConfigError("critic_adapter.targets: lm_head is not a critic's (its value head, score, trains "
                              "whole beside the adapters)")

    def as_adapter(self) -> AdapterConfig:
        """The same values as the critic's run's `adapter` section (the critic is built as a model of its own)."""
        return AdapterConfig(rank=self.rank, alpha=self.alpha, targets=self.targets, base_dtype=self.base_dtype,
                             prompt=self.prompt)
