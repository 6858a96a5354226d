"""The GLM-5.3-Flash family (`Glm5NextForConditionalGeneration`'s text decoder, `glm5_next` in transformers): Kimi
Delta Attention + MLA/DSA with pooled indexer keys + dense/MoE MLPs, in hyper-connection residual streams. One file
per concern: config/glm5_next.py (dimensions, layouts, GLM-5.3-Flash's), models/glm5_next.py (the spec; the mixers
in models/mixers/kda.py and mla_kpool.py, the streams in models/hyper_connection.py), checkpoint/glm5_next.py
(config.json and the mapping table); its layer types' records below. docs/glm5-next-plan.md: the design and what
is still to build (the pooled indexer's prompt state, the planner's own terms)."""

from __future__ import annotations

import dataclasses

from longstraw_mcore.checkpoint import glm5_next as checkpoint, heads
from longstraw_mcore.config import Glm5NextConfig
from longstraw_mcore.families.glm_dsa import LAYERS as GLM_LAYERS
from longstraw_mcore.families.record import Family
from longstraw_mcore.planner.activations import gdn_backward_scratch, gdn_capture_bytes, rms_norm_bytes
from longstraw_mcore.planner.activations_glm5_next import kda_layer_bytes, mla_kpool_layer_bytes
from longstraw_mcore.planner.flops_glm5_next import KDAFlops, MLAKpoolFlops
from longstraw_mcore.prompt_state.gdn import GDNRecurrentState
from longstraw_mcore.prompt_state.kinds import LayerKind
from longstraw_mcore.prompt_state.mla_pool import MLAPoolIndexerState

# The planner's terms: FLOPs (planner/flops_glm5_next.py) and saved activations (planner/activations_glm5_next.py)
# are the family's own; the capture peaks and backward scratch are the nearest existing ones (Gated DeltaNet's for
# KDA, GLM-5.2's for MLA), not yet measured for this family.
LAYERS = {
    # KDA's state is Gated DeltaNet's with one key head per value head (the config names its dimensions so)
    "kda": LayerKind(state=GDNRecurrentState, activation_bytes=kda_layer_bytes, norm_bytes=rms_norm_bytes,
                     flops=KDAFlops(), capture_bytes=gdn_capture_bytes, backward_scratch=gdn_backward_scratch),
    "mla_dsa_full": dataclasses.replace(GLM_LAYERS["mla_dsa_full"], state=MLAPoolIndexerState,
                                        activation_bytes=mla_kpool_layer_bytes, flops=MLAKpoolFlops(indexer=True)),
    "mla_dsa_shared": dataclasses.replace(GLM_LAYERS["mla_dsa_shared"], activation_bytes=mla_kpool_layer_bytes,
                                          flops=MLAKpoolFlops(indexer=False)),
}


def build_model(model_cfg: Glm5NextConfig, parallel, device: str, head: str = "lm", vp_stage: int | None = None):
    """This rank's part of the model (models/glm5_next.py), with the family's layer records."""
    from longstraw_mcore.models.glm5_next import build_model as build

    return build(model_cfg, parallel, device, LAYERS, head, vp_stage)


FAMILY = Family(name="glm5_next", config=Glm5NextConfig, build_model=build_model, checkpoint=checkpoint,
                architectures=checkpoint.ARCHITECTURES, layers=LAYERS)
