"""The decoder-only language model every family builds on: embedding, a block of the family's layers,
final norm and an untied output layer, on Megatron-Core (no Megatron class is forked).

    embedding        Megatron's vocab-parallel `LanguageModelEmbedding` (first pipeline stage)
    decoder          Megatron's `TransformerBlock` of the layers the family's spec gives this stage
    output_layer     a `ColumnParallelLinear` whose logits stay vocab-parallel (last stage), or a critic's /
                     reward model's scalar head (`head`: models/heads.py)

A family's model module (models/qwen3_5.py, models/glm5.py) supplies the TransformerConfig and the
block spec of a stage; the family record (families/) hands in its per-layer-type records, which the
replay engine reaches through `ReplayModelMixin` (models/replay_interface.py) and nothing else.
Cached prompt state reaches the mixers through Megatron's `inference_context` argument
(prompt_state/hooks.py).

The vocabulary is padded as Megatron pads it (`model.make_vocab_size_divisible_by` x tp): the
embedding and output layer have V_pad rows, the padded rows are never looked up and their logits
are masked out of every log-prob (loss/logprobs.py), so they get no gradient; checkpoints record
the padded tensors with `allow_shape_mismatch` (any padding loads), conversion and gathered
tensors carry the true vocabulary.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from longstraw_mcore.config import ModelConfig, ParallelConfig
from longstraw_mcore.models.heads import make_head
from longstraw_mcore.models.replay_interface import ReplayModelMixin
from longstraw_mcore.prompt_state.hooks import StateHooks


def pipeline_kwargs(num_layers: int, p: ParallelConfig) -> dict:
    """TransformerConfig fields for pp > 1 (none at pp = 1). Megatron's layout places the stages' layers
    (uneven splits too; layer numbers and checkpoint keys follow it), the embedding first and the output
    layer ("loss") last; branches and capture chunks differ in length, so the pipeline exchanges shapes
    (variable_seq_lengths), which Megatron refuses with its default MoE dispatcher, even without experts."""
    if p.pp == 1:
        return {}
    layout = [["decoder"] * n for n in p.virtual_stage_layers(num_layers)]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    kw = dict(pipeline_model_parallel_layout=layout, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if p.vpp > 1:  # virtual stage v x pp + r is rank r's chunk v; micro-batches go through a chunk pp at a time.
        # Unbatched p2p, as Megatron runs its interleaved schedule with overlap: its batched ops, at pp = 2,
        # pair a send to the peer as "next" with the peer's receive from it as "prev" in the wrong role
        # (parallel/p2p_shapes.py: the same crossing in the shape exchange)
        kw.update(virtual_pipeline_model_parallel_size=p.vpp, microbatch_group_size_per_vp_stage=p.pp,
                  batch_p2p_comm=False)
    return kw


def built_layout(parallel, with_ep: bool = False) -> ParallelConfig:
    """The ParallelConfig of a set-up rank's layout (parallel/groups.Parallel): its pipeline split (per
    virtual stage at vpp > 1) for the TransformerConfig; `with_ep`: the MoE families' expert parallel size."""
    return ParallelConfig(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, ep=parallel.ep if with_ep else 1,
                          pp_layers=parallel.virtual_layers or parallel.stage_layers, vpp=parallel.vpp)


def stage_range(parallel, vp_stage: int | None = None) -> range:
    """The global (0-based) layers this rank's pipeline stage owns, or at vpp > 1 its chunk `vp_stage`'s."""
    if parallel.vpp > 1:
        if vp_stage is None:
            raise ValueError(f"parallel.vpp={parallel.vpp}: a rank's layers are its chunks', not one range; name the "
                             "chunk (vp_stage)")
        v = parallel.virtual_layers
        stage = vp_stage * parallel.pp + parallel.pp_rank
        first = sum(v[:stage])
        return range(first, first + v[stage])
    stages = parallel.stage_layers
    first = sum(stages[:parallel.pp_rank])
    return range(first, first + stages[parallel.pp_rank])


class ReplayLanguageModel(ReplayModelMixin, LanguageModule):
    """Embedding (first stage) -> TransformerBlock of `spec` -> final norm + output layer (last stage).

    forward returns vocab-parallel logits `[B, T, V_pad/tp]` on the last stage (columns at or beyond
    `model_cfg.vocab_size` are padding), hidden states `[T, B, Hd]` elsewhere (Megatron's pipeline
    contract). `layer_kinds`: the family's record per layer type (prompt_state/kinds.py); `kv_group`:
    this rank's KV group when tensor parallelism exceeds the state's heads (parallel/kv_group.py)."""

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, pg_collection,
                 spec: TransformerBlockSubmodules, layer_kinds: dict, kv_group=None, pre_process: bool = True,
                 post_process: bool = True, head: str = "lm", vp_stage: int | None = None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.model_cfg, self.layer_kinds, self.kv_group, self.head = model_cfg, layer_kinds, kv_group, head
        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = False
        self.vocab_size = model_cfg.vocab_size
        self.padded_vocab_size = model_cfg.padded_vocab_size(pg_collection.tp.size())
        if pre_process:
            self.embedding = LanguageModelEmbedding(config=config, vocab_size=self.padded_vocab_size,
                                                    max_sequence_length=1, position_embedding_type="none",
                                                    tp_group=pg_collection.tp)
        self.decoder = TransformerBlock(config=config, spec=spec, pre_process=pre_process,
                                        post_process=post_process, pg_collection=pg_collection, vp_stage=vp_stage)
        if post_process and head != "lm":  # a critic's or a reward model's scalar head (models/heads.py)
            self.output_layer = make_head(head, config.hidden_size, config.params_dtype)
        elif post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, config=config, init_method=config.init_method,
                bias=False, skip_bias_add=False, gather_output=False, tp_group=pg_collection.tp)
        self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "one input tensor per stage"
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def decoder_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding [T, B, Hd], copied into the residual streams where the family has several ([T, B, n Hd],
        `ModelBase.residual_streams`: models/hyper_connection.py)."""
        x = self.embedding(input_ids=input_ids, position_ids=None)
        n = self.model_cfg.residual_streams
        return x if n == 1 else x.repeat(1, 1, n)

    def forward(self, input_ids: torch.Tensor, position_ids=None, attention_mask=None,
                state: StateHooks | None = None, hidden_only: bool = False, **kwargs) -> torch.Tensor:
        """input_ids [B, T] (first stage; other stages take the tensor from `set_input_tensor`).

        `hidden_only`: return the decoder output `[T, B, Hd]` (after the final norm on the last stage)
        without the output layer: prompt capture needs no logits, and log-probs are computed from
        hidden states in token chunks (loss/logprobs.py)."""
        decoder_input = self.decoder_input(input_ids) if self.pre_process else None
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=None, inference_context=state)
        if not self.post_process or hidden_only:
            return hidden
        logits, _ = self.output_layer(hidden)
        return logits.transpose(0, 1).contiguous()


def build(transformer_config: TransformerConfig, model_cfg: ModelConfig, parallel, spec, layer_kinds: dict,
          device: str, head: str = "lm", vp_stage: int | None = None) -> ReplayLanguageModel:
    """This rank's part of the model (its pipeline stage, or at vpp > 1 its chunk `vp_stage`; its TP shard)
    on `device`: the embedding in the first virtual stage, the output layer in the last."""
    first = vp_stage in (None, 0)
    last = vp_stage is None or vp_stage == parallel.vpp - 1
    model = ReplayLanguageModel(transformer_config, model_cfg, parallel.pgs, spec, layer_kinds,
                                kv_group=parallel.tp_kv, pre_process=parallel.is_first_stage and first,
                                post_process=parallel.is_last_stage and last, head=head, vp_stage=vp_stage)
    return model.cuda() if device == "cuda" else model


def gather_vocab(logits_local: torch.Tensor, tp_group, vocab_size: int | None = None) -> torch.Tensor:
    """[..., V_pad/tp] -> [..., V_pad], or [..., vocab_size] without the padding (for tests and small
    outputs; training never materialises full logits)."""
    full = logits_local if tp_group.size() == 1 else \
        tensor_parallel.gather_from_tensor_model_parallel_region(logits_local, group=tp_group)
    return full if vocab_size is None else full[..., :vocab_size]
