"""The Qwen3.5 / Qwen3.6 hybrid family (Gated DeltaNet + gated full attention, `qwen3_5` in
transformers): spec builder in models/qwen3_5.py, mapping table in checkpoint/qwen3_5.py, config
reader in checkpoint/hf.py; full-attention layers keep K/V, Gated DeltaNet layers their recurrent state."""

from __future__ import annotations

from longstraw_mcore.checkpoint import qwen3_5 as mapping
from longstraw_mcore.families import Family
from longstraw_mcore.prompt_state.attention_kv import AttentionKV
from longstraw_mcore.prompt_state.gdn import GDNRecurrentState


def _build_model(model_cfg, parallel, device):
    from longstraw_mcore.models.qwen3_5 import build_model

    return build_model(model_cfg, parallel, device)


def _read_hf_config(path):
    from longstraw_mcore.checkpoint.hf import read_config

    return read_config(path)


FAMILY = Family(
    name="qwen3_5",
    build_model=_build_model,
    read_hf_config=_read_hf_config,
    mapping=mapping,
    architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    state_kinds={"full_attention": AttentionKV, "linear_attention": GDNRecurrentState},
)
