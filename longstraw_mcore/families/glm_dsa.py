"""The GLM-5.x family (`GlmMoeDsaForCausalLM`, `glm_moe_dsa` in transformers): MLA + DeepSeek Sparse
Attention with IndexShare, dense then MoE layers. One file per concern: config/glm_dsa.py (dimensions,
layouts, GLM-5.2's), models/glm5.py (the spec; the mixer in models/mixers/mla_dsa.py),
checkpoint/glm_dsa.py (config.json and the mapping table); its layer types' records below: full
indexer layers keep the MLA latent and the indexer key per position, shared ones the latent only."""

from __future__ import annotations

from longstraw_mcore.checkpoint import glm_dsa as checkpoint
from longstraw_mcore.config import GlmDsaConfig
from longstraw_mcore.families.record import Family
from longstraw_mcore.planner.activations import glm_layer_bytes, index_bytes, rms_norm_bytes
from longstraw_mcore.planner.flops_mla import MLADSAFlops
from longstraw_mcore.prompt_state.kinds import LayerKind
from longstraw_mcore.prompt_state.mla import MLAIndexerState, MLALatentState

LAYERS = {
    "mla_dsa_full": LayerKind(state=MLAIndexerState, activation_bytes=glm_layer_bytes, norm_bytes=rms_norm_bytes,
                              flops=MLADSAFlops(indexer=True), scratch_bytes=index_bytes),
    "mla_dsa_shared": LayerKind(state=MLALatentState, activation_bytes=glm_layer_bytes, norm_bytes=rms_norm_bytes,
                                flops=MLADSAFlops(indexer=False)),
}


def build_model(model_cfg: GlmDsaConfig, parallel, device: str):
    """This rank's part of the model (models/glm5.py), with the family's layer records."""
    from longstraw_mcore.models.glm5 import build_model as build

    return build(model_cfg, parallel, device, LAYERS)


FAMILY = Family(name="glm_dsa", config=GlmDsaConfig, build_model=build_model, checkpoint=checkpoint,
                architectures=checkpoint.ARCHITECTURES, layers=LAYERS)
