"""The Qwen3.5/3.6 hybrid decoder on Megatron-Core: spec builder, TransformerConfig, model.

One spec builder for the family: each layer is Megatron's `TransformerLayer` with
  input_layernorm = ZeroCenteredRMSNorm, self_attention = GatedDeltaNetMixer | GatedAttentionMixer
  (by `full_attention_interval`), pre_mlp_layernorm = ZeroCenteredRMSNorm, mlp = Megatron SwiGLU MLP.
The block is Megatron's `TransformerBlock` (pipeline stages own contiguous layer ranges), the
embedding Megatron's vocab-parallel `LanguageModelEmbedding`, the untied output layer a
`ColumnParallelLinear` whose logits stay vocab-parallel. No Megatron class is forked.

Cached prompt state reaches the mixers through Megatron's `inference_context` argument as a
context (models/mixers/state.py, prompt_state/contexts.py); nothing else in the model knows about
branch replay. The replay engine reaches the model only through `ReplayModelMixin`
(models/replay_interface.py).

The vocabulary is padded as Megatron pads it (`model.make_vocab_size_divisible_by` x tp): the
embedding and output layer have V_pad rows, the padded rows are never looked up and their logits
are masked out of every log-prob (loss/logprobs.py), so they get no gradient; checkpoints record
the padded tensors with `allow_shape_mismatch` (any padding loads), conversion and gathered
tensors carry the true vocabulary.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from longstraw_mcore import cpu_compat
from longstraw_mcore.config import ModelConfig, ParallelConfig
from longstraw_mcore.models.mixers.gated_attention import GatedAttentionMixer, GatedAttentionSubmodules
from longstraw_mcore.models.mixers.gated_deltanet import GatedDeltaNetMixer, GatedDeltaNetSubmodules
from longstraw_mcore.models.mixers.state import StateContext
from longstraw_mcore.models.norms import ZeroCenteredRMSNorm
from longstraw_mcore.models.replay_interface import ReplayModelMixin


def transformer_config(m: ModelConfig, p: ParallelConfig, device: str) -> TransformerConfig:
    """Megatron TransformerConfig for the family; CPU conventions come from cpu_compat."""
    dtype = m.torch_dtype
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.intermediate_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_key_value_heads, kv_channels=m.head_dim,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        normalization="RMSNorm", layernorm_epsilon=m.rms_norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
        sequence_parallel=False, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        init_method_std=0.02,
        # Mixed layer types: checkpoint keys per global layer (decoder.layers.{i}.*), never stacked.
        hetereogenous_dist_checkpoint=True,
    )
    kwargs.update(pipeline_kwargs(m.num_layers, p))
    if device == "cpu":
        kwargs.update(cpu_compat.cpu_config_overrides())
    return TransformerConfig(**kwargs)


def pipeline_kwargs(num_layers: int, p: ParallelConfig) -> dict:
    """TransformerConfig fields for pp > 1 (none at pp = 1). Megatron's layout places the stages' layers
    (uneven splits too; layer numbers and checkpoint keys follow it), the embedding first and the output
    layer ("loss") last; branches and capture chunks differ in length, so the pipeline exchanges shapes
    (variable_seq_lengths), which Megatron refuses with its default MoE dispatcher, even without experts."""
    if p.pp == 1:
        return {}
    layout = [["decoder"] * n for n in p.stage_layers(num_layers)]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return dict(pipeline_model_parallel_layout=layout, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")


def layer_spec(layer_type: str, m: ModelConfig) -> ModuleSpec:
    if layer_type == "full_attention":
        mixer = ModuleSpec(module=GatedAttentionMixer, submodules=GatedAttentionSubmodules(), params={"model_cfg": m})
    elif layer_type == "linear_attention":
        mixer = ModuleSpec(module=GatedDeltaNetMixer, submodules=GatedDeltaNetSubmodules(), params={"model_cfg": m})
    else:
        raise ValueError(f"layer type {layer_type!r}: expected 'full_attention' or 'linear_attention'")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ZeroCenteredRMSNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=ZeroCenteredRMSNorm,
            mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                       linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(m: ModelConfig, pp_rank: int, stages: list[int]) -> TransformerBlockSubmodules:
    """The layers this pipeline stage owns (contiguous; `stages`: layers per stage), plus the final norm."""
    first = sum(stages[:pp_rank])
    types = m.layer_types[first:first + stages[pp_rank]]
    return TransformerBlockSubmodules(layer_specs=[layer_spec(t, m) for t in types],
                                      layer_norm=ZeroCenteredRMSNorm)


class Qwen35HybridModel(ReplayModelMixin, LanguageModule):
    """Embedding (first stage) -> hybrid TransformerBlock -> final norm + output layer (last stage).

    forward returns vocab-parallel logits `[B, S, V_pad/tp]` on the last stage (columns at or beyond
    `model_cfg.vocab_size` are padding), hidden states `[S, B, Hd]` elsewhere (Megatron's pipeline
    contract)."""

    block_spec_fn = staticmethod(block_spec)  # the family's layers (GLM-5.x: models/glm5.py)

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, pg_collection,
                 pre_process: bool = True, post_process: bool = True):
        super().__init__(config=config, pg_collection=pg_collection)
        self.model_cfg = model_cfg
        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = False
        self.vocab_size = model_cfg.vocab_size
        self.padded_vocab_size = model_cfg.padded_vocab_size(pg_collection.tp.size())
        if pre_process:
            self.embedding = LanguageModelEmbedding(config=config, vocab_size=self.padded_vocab_size,
                                                    max_sequence_length=1, position_embedding_type="none",
                                                    tp_group=pg_collection.tp)
        stages = [model_cfg.num_layers] if config.pipeline_model_parallel_layout is None else \
            [row[0].count(LayerType.decoder) for row in config.pipeline_model_parallel_layout.layout]
        spec = self.block_spec_fn(model_cfg, pg_collection.pp.rank(), stages)
        self.decoder = TransformerBlock(config=config, spec=spec, pre_process=pre_process,
                                        post_process=post_process, pg_collection=pg_collection)
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, config=config, init_method=config.init_method,
                bias=False, skip_bias_add=False, gather_output=False, tp_group=pg_collection.tp)
        self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "one input tensor per stage"
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, position_ids=None, attention_mask=None,
                state: StateContext | None = None, hidden_only: bool = False, **kwargs) -> torch.Tensor:
        """input_ids [B, S] (first stage; other stages take the tensor from `set_input_tensor`).

        `hidden_only`: return the decoder output `[S, B, Hd]` (after the final norm on the last stage)
        without the output layer: prompt capture needs no logits, and log-probs are computed from
        hidden states in token chunks (loss/logprobs.py)."""
        decoder_input = self.embedding(input_ids=input_ids, position_ids=None) if self.pre_process else None
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=None, inference_context=state)
        if not self.post_process or hidden_only:
            return hidden
        logits, _ = self.output_layer(hidden)
        return logits.transpose(0, 1).contiguous()


def build_model(model_cfg: ModelConfig, parallel, device: str) -> Qwen35HybridModel:
    """Build this rank's part of the model (its pipeline stage, its TP shard) on `device`."""
    from longstraw_mcore.config import ParallelConfig as PC

    pc = PC(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, pp_layers=getattr(parallel, "stage_layers", None))
    cfg = transformer_config(model_cfg, pc, device)
    model = Qwen35HybridModel(cfg, model_cfg, parallel.pgs, pre_process=parallel.is_first_stage,
                              post_process=parallel.is_last_stage)
    if device == "cuda":
        model = model.cuda()
    return model


def gather_vocab(logits_local: torch.Tensor, tp_group, vocab_size: int | None = None) -> torch.Tensor:
    """[..., V_pad/tp] -> [..., V_pad], or [..., vocab_size] without the padding (for tests and small
    outputs; training never materialises full logits)."""
    full = logits_local if tp_group.size() == 1 else \
        tensor_parallel.gather_from_tensor_model_parallel_region(logits_local, group=tp_group)
    return full if vocab_size is None else full[..., :vocab_size]
