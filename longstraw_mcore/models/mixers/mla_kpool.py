"""GLM-5.3-Flash's MLA + DSA layer (transformers' `Glm5NextTextAttention`): GLM-5.2's mixer (models/mixers/mla_dsa.py)
without RoPE, with its latent norms at the config's eps, and an indexer that scores pools of tokens.

    as MLADSAMixer, with qk_rope_head_dim = 0: no RoPE key, no rotation anywhere (queries, keys, indexer)
    q_a_layernorm, kv_a_layernorm: eps = rms_norm_eps (GLM-5.2's take a fixed 1e-6)
    "full" layer: the indexer's raw keys kI = k_norm(wk(x)) and gate scores gI = x kpool_gate^T per token
    (`ctx.latent` hands them on in MLAKeys.ik / .ig); the queries choose index_topk / index_kpool pools of
    index_kpool tokens plus their own incomplete pool (ops/dsa_pool.py); "shared": the full layer's choice,
    from the layer directly before it (Glm5NextConfig refuses any other placement)

The indexer's extra weights kpool_ape [kpool, Di] and kpool_gate [Di, Hd] are replicated over TP, like the rest of
the indexer, and get no gradient (transformers runs its indexer under no_grad).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw_mcore.models.mixers.mla_dsa import MLADSAMixer, MLADSASubmodules
from longstraw_mcore.prompt_state.hooks import MLAKeys

__all__ = ["MLAKpoolMixer", "MLADSASubmodules"]


class MLAKpoolMixer(MLADSAMixer):
    def __init__(self, config, submodules: MLADSASubmodules, layer_number: int, pg_collection=None, model_cfg=None,
                 share=None, kv=None, **kwargs):
        super().__init__(config, submodules, layer_number, pg_collection=pg_collection, model_cfg=model_cfg,
                         share=share, kv=kv, **kwargs)
        m = model_cfg
        if m.qk_rope_head_dim:
            raise ValueError(f"MLAKpoolMixer: qk_rope_head_dim={m.qk_rope_head_dim}; GLM-5.3-Flash's MLA has no RoPE")
        self.q_a_layernorm.eps = self.kv_a_layernorm.eps = m.rms_norm_eps
        if self.full:
            dtype = config.params_dtype
            self.indexer.kpool_ape = torch.nn.Parameter(torch.zeros(m.index_kpool, m.index_head_dim, dtype=dtype))
            self.indexer.kpool_gate = torch.nn.Parameter(torch.zeros(m.index_head_dim, config.hidden_size, dtype=dtype))

    def _rope(self, x, pos):
        return x

    def _own(self, x, pos) -> MLAKeys:
        own = super()._own(x, pos)
        if self.full:
            with torch.no_grad():
                own.ig = F.linear(x, self.indexer.kpool_gate)
            own.pooling = (self.indexer.kpool_ape, self.m.index_kpool)
        return own

    def _pool(self):
        return (self.indexer.kpool_ape, self.m.index_kpool) if self.full else None
