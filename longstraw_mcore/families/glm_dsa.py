"""The GLM-5.x family (`GlmMoeDsaForCausalLM`, `glm_moe_dsa` in transformers): MLA + DeepSeek Sparse
Attention with IndexShare, dense then MoE layers. Spec builder in models/glm5.py, name table in
checkpoint/glm_dsa.py; full indexer layers keep the MLA latent and the indexer key per position,
shared ones the latent only (prompt_state/mla.py)."""

from __future__ import annotations

from longstraw_mcore.checkpoint import glm_dsa as mapping
from longstraw_mcore.families import Family
from longstraw_mcore.prompt_state.mla import MLAIndexerState, MLALatentState


def _build_model(model_cfg, parallel, device):
    from longstraw_mcore.models.glm5 import build_model

    return build_model(model_cfg, parallel, device)


def _read_hf_config(path):
    from longstraw_mcore.checkpoint.common import CheckpointError

    raise CheckpointError(f"{path}: reading GLM-5.x (GlmMoeDsaForCausalLM) checkpoints is not built yet")


FAMILY = Family(
    name="glm_dsa",
    build_model=_build_model,
    read_hf_config=_read_hf_config,
    mapping=mapping,
    architectures=("GlmMoeDsaForCausalLM",),
    state_kinds={"mla_dsa_full": MLAIndexerState, "mla_dsa_shared": MLALatentState},
)
