"""The GLM-5.x family (`GlmMoeDsaForCausalLM`, `glm_moe_dsa` in transformers): MLA + DeepSeek Sparse
Attention with IndexShare, dense then MoE layers. One file per concern: config/glm_dsa.py (dimensions,
layouts, GLM-5.2's), models/glm5.py (the spec; the mixer in models/mixers/mla_dsa.py),
checkpoint/glm_dsa.py (config.json and the mapping table); its layer types' records below: full
indexer layers keep the MLA latent and the indexer key per position, shared ones the latent only."""

from __future__ import annotations

from longstraw_mcore.checkpoint import glm_dsa as checkpoint, heads
from longstraw_mcore.config import GlmDsaConfig
from longstraw_mcore.families.record import Family
from longstraw_mcore.ops.kernel_choice import dsa_kernel_name
from longstraw_mcore.planner.activations import (glm_layer_bytes, index_bytes, mla_backward_scratch, mla_checkpoints,
                                                 rms_norm_bytes)
from longstraw_mcore.planner.flops_mla import MLADSAFlops
from longstraw_mcore.prompt_state.kinds import LayerKind
from longstraw_mcore.prompt_state.mla import MLAIndexerState, MLALatentState



def dsa_kernel(ops, device: str, dtype: str) -> str:
    """The DSA kernels ops.dsa runs on `device` (the planner's memory terms follow them)."""
    return dsa_kernel_name(ops.dsa, device, dtype)


_PLANNER = dict(activation_bytes=glm_layer_bytes, norm_bytes=rms_norm_bytes, backward_scratch=mla_backward_scratch,
                kernel_name=dsa_kernel, checkpoints=mla_checkpoints)
LAYERS = {
    "mla_dsa_full": LayerKind(state=MLAIndexerState, flops=MLADSAFlops(indexer=True), scratch_bytes=index_bytes,
                              **_PLANNER),
    "mla_dsa_shared": LayerKind(state=MLALatentState, flops=MLADSAFlops(indexer=False), **_PLANNER),
}


def build_model(model_cfg: GlmDsaConfig, parallel, device: str, head: str = "lm", vp_stage: int | None = None):
    """This rank\'s part of the model (models/glm5.py), with the family\'s layer records; `head`:
    models/heads.py; `vp_stage`: its model chunk at parallel.vpp > 1."""
    from longstraw_mcore.models.glm5 import build_model as build

    return build(model_cfg, parallel, device, LAYERS, head, vp_stage)


FAMILY = Family(name="glm_dsa", config=GlmDsaConfig, build_model=build_model, checkpoint=checkpoint,
                architectures=heads.architectures(checkpoint), layers=LAYERS)
