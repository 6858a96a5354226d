"""The small interface the replay engine reaches a model through (and nothing else of it).

    state_kinds()                        {local layer number: its family's LayerKind} of this stage
                                         (prompt_state/kinds.py; the containers allocate from them)
    kv_group                             this rank's KV group (tensor parallelism beyond the state's
                                         heads: parallel/kv_group.py), or None
    forward_hidden(input_ids, state)     decoder output [T, B, Hd] under a prompt-state context
    forward_state(input_ids, state)      exact mode's recompute of a prompt chunk: this stage's
                                         layers; on the last stage the last layer only as far as
                                         its state (its output feeds nothing), returning None
    token_outputs(hidden, targets, n)    per-token outputs [B, T]: log-probs of the targets (vocab-parallel,
                                         n tokens at a time, padded vocabulary entries masked out), or a
                                         critic's values / a reward model's scores (models/heads.py)
    tp_size                              tensor-parallel size of the state
    cp_group                             the context-parallel group (Megatron's LanguageModule sets it)

Mixed into models/language_model.py's model class; the family's mixers provide `produce_state`.
"""

from __future__ import annotations

import torch

from longstraw_mcore.loss.logprobs import token_logprobs
from longstraw_mcore.models.heads import token_values


class ReplayModelMixin:
    def state_kinds(self) -> dict:
        types = self.model_cfg.layer_types
        return {layer.layer_number: self.layer_kinds[types[layer.layer_number - 1]] for layer in self.decoder.layers}

    @property
    def tp_size(self) -> int:
        return self.pg_collection.tp.size()

    def forward_hidden(self, input_ids: torch.Tensor, state) -> torch.Tensor:
        return self(input_ids, state=state, hidden_only=True)

    def forward_state(self, input_ids: torch.Tensor, state) -> torch.Tensor | None:
        hidden = self.decoder_input(input_ids) if self.pre_process else self.decoder.input_tensor
        layers = list(self.decoder.layers)
        stop_early = self.post_process  # only the model's last layer has an output nobody needs
        for layer in (layers[:-1] if stop_early else layers):
            hidden, _ = layer(hidden_states=hidden, attention_mask=None, inference_context=state)
        if not stop_early:
            return hidden
        last = layers[-1]
        from longstraw_mcore.memory.layers import layer_state
        from longstraw_mcore.memory.staging import staged

        with staged(layer_state(state, last.layer_number), hidden.device):  # memory.state_offload / fp8
            normed = last.input_layernorm(hidden)  # a norm slot may return (output, residual) (hyper-connections)
            last.self_attention.produce_state(normed[0] if isinstance(normed, tuple) else normed, state)
        return None

    def token_outputs(self, hidden: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        if getattr(self, "head", "lm") != "lm":
            return token_values(self.output_layer, hidden)
        return token_logprobs(self.output_layer, hidden, targets, chunk, vocab_size=self.model_cfg.vocab_size)
