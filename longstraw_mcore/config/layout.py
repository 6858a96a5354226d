"""The parallel layout: tensor, pipeline, context and expert parallel sizes (data parallel is what the
world size leaves) and the pipeline's layer split."""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_mcore.config.errors import ConfigError, check_ints


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
    layer on the last (both families keep them untied). With vpp > 1, one count per virtual stage, in
    the order the data flows (pp x vpp counts)."""
    vpp: int = 1
    """Model chunks per pipeline rank: Megatron's interleaved (virtual) pipeline stages, a bubble of
    (pp - 1) / (vpp k + pp - 1) for k micro-batches instead of (pp - 1) / (k + pp - 1). Virtual stage
    v x pp + r is rank r's chunk v (models/language_model.py); the replay engine and sampling run the
    chunks through Megatron's interleaved schedule (replay/pipeline.py, models/chunks.py). `train`
    and `rollout` take it; validate and smoke do not yet (commands/preflight.py), nor PPO's critic and
    Megatron's distributed optimizer (RunConfig refuses them)."""

    def __post_init__(self) -> None:
        check_ints(self, "parallel", ("tp", "pp", "cp", "ep", "vpp"))
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(f"parallel.vpp={self.vpp} needs parallel.pp > 1 (model chunks interleave over "
                              "pipeline ranks)")
        if self.pp_layers is not None:
            pl = self.pp_layers
            if not isinstance(pl, (list, tuple)) or any(not isinstance(n, int) or isinstance(n, bool) or n < 1
                                                         for n in pl):
                raise ConfigError(f"parallel.pp_layers={pl!r}: must be a list of positive layer counts, one per "
                                  f"pipeline stage")
            if len(pl) != self.pp * self.vpp:
                per = "stage" if self.vpp == 1 else f"virtual stage (pp x vpp = {self.pp * self.vpp})"
                raise ConfigError(f"parallel.pp_layers={list(pl)} has {len(pl)} stages but parallel.pp={self.pp}"
                                  + (f", parallel.vpp={self.vpp}" if self.vpp > 1 else "")
                                  + f"; give one layer count per {per}")
            self.pp_layers = list(pl)

    def virtual_stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per virtual stage (pp x vpp of them; the pipeline stages at vpp = 1); raises
        ConfigError when they do not add up."""
        n = self.pp * self.vpp
        if self.pp_layers is not None:
            if sum(self.pp_layers) != num_layers:
                raise ConfigError(f"parallel.pp_layers={self.pp_layers} adds up to {sum(self.pp_layers)} layers but "
                                  f"model.num_layers={num_layers}")
            return list(self.pp_layers)
        if num_layers % n:
            what = f"parallel.pp={self.pp}" if self.vpp == 1 else f"parallel.pp x parallel.vpp = {n}"
            raise ConfigError(f"model.num_layers={num_layers} is not divisible by {what}; set parallel.pp_layers "
                              f"(a layer count per {'stage' if self.vpp == 1 else 'virtual stage'}, adding up to "
                              f"{num_layers})")
        return [num_layers // n] * n

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline rank (its virtual stages' together); raises ConfigError when they do
        not add up."""
        v = self.virtual_stage_layers(num_layers)
        return [sum(v[c * self.pp + r] for c in range(self.vpp)) for r in range(self.pp)]

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
