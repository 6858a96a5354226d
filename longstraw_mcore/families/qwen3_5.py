"""The Qwen3.5 / Qwen3.6 hybrid family (Gated DeltaNet + gated full attention, `qwen3_5` in
transformers), one file per concern: config/qwen3_5.py (dimensions, layouts), models/qwen3_5.py (the
spec on Megatron-Core), checkpoint/qwen3_5.py (config.json and the mapping table); its layer types'
records below: full-attention layers keep K/V, Gated DeltaNet layers their recurrent state."""

from __future__ import annotations

from functools import partial

from longstraw_mcore.checkpoint import heads, qwen3_5 as checkpoint
from longstraw_mcore.config import Qwen35Config
from longstraw_mcore.families.record import Family
from longstraw_mcore.planner.activations import (attention_backward_scratch, attention_bytes, attention_capture_bytes,
                                                 gdn_backward_scratch, gdn_bytes, gdn_capture_bytes, hybrid_layer_bytes,
                                                 zero_centred_norm_bytes)
from longstraw_mcore.planner.flops_hybrid import GatedAttentionFlops, GatedDeltaNetFlops
from longstraw_mcore.prompt_state.attention_kv import AttentionKV
from longstraw_mcore.prompt_state.gdn import GDNRecurrentState
from longstraw_mcore.prompt_state.kinds import LayerKind

LAYERS = {
    "full_attention": LayerKind(state=AttentionKV, activation_bytes=partial(hybrid_layer_bytes, attention_bytes),
                                norm_bytes=zero_centred_norm_bytes, flops=GatedAttentionFlops(),
                                capture_bytes=attention_capture_bytes, backward_scratch=attention_backward_scratch),
    "linear_attention": LayerKind(state=GDNRecurrentState, activation_bytes=partial(hybrid_layer_bytes, gdn_bytes),
                                  norm_bytes=zero_centred_norm_bytes, flops=GatedDeltaNetFlops(),
                                  capture_bytes=gdn_capture_bytes, backward_scratch=gdn_backward_scratch),
}


def build_model(model_cfg: Qwen35Config, parallel, device: str, head: str = "lm", vp_stage: int | None = None):
    """This rank\'s part of the model (models/qwen3_5.py), with the family\'s layer records; `head`:
    models/heads.py; `vp_stage`: its model chunk at parallel.vpp > 1."""
    from longstraw_mcore.models.qwen3_5 import build_model as build

    return build(model_cfg, parallel, device, LAYERS, head, vp_stage)


FAMILY = Family(name="qwen3_5", config=Qwen35Config, build_model=build_model, checkpoint=checkpoint,
                architectures=heads.architectures(checkpoint), layers=LAYERS)
