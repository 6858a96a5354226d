"""GLM-5.2's mixture of experts on Megatron's `MoELayer` (no fork): the TransformerConfig fields that
make Megatron's router and experts compute what `GlmMoeDsaMoE` computes, and the layer builder.

GLM-5.2 (Hugging Face `GlmMoeDsaTopkRouter` / `GlmMoeDsaMoE`): router logits x W^T, scores =
sigmoid(logits); experts chosen by the top-k of scores + a score-correction bias (aux-loss-free
balancing: the bias steers the choice only), the chosen scores normalised to sum 1 (+1e-20) and
scaled by `routed_scaling_factor` (2.5); SwiGLU experts; one shared SwiGLU expert of
moe_intermediate_size x n_shared_experts added to every token; n_group = topk_group = 1 (no group
limit). Megatron's `topk_routing_with_score_function` with score function "sigmoid", the expert
bias and the scaling factor computes the same, and its `_build_shared_experts` adds the shared
expert. Token dispatcher: `alltoall` (runs on CPU/gloo with the patches in cpu_compat.py, and on
CUDA; `allgather` refuses the variable sequence lengths branch replay and pipelines need).

The expert bias is a buffer in float32 (Megatron keeps it so); it is loaded from the checkpoint's
`e_score_correction_bias` and not updated here (moe_router_bias_update_rate=0): a policy-gradient
step should not move the routing balance behind the optimizer's back. Megatron's router computes
the sigmoid scores in float32 (`logits.float()`), also in a float64 model.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def moe_config_kwargs(num_experts: int, topk: int, moe_ffn_hidden_size: int, n_shared_experts: int,
                      routed_scaling_factor: float, n_group: int = 1, topk_group: int = 1,
                      router_dtype: str = "fp32") -> dict:
    """TransformerConfig fields for GLM-5.2's MoE layers (dense layers need none). `router_dtype`: the
    router's logits ("fp32" as GLM-5.2 computes them; "fp64" for float64 validation runs)."""
    if num_experts < 1 or not 1 <= topk <= num_experts:
        raise ValueError(f"n_routed_experts={num_experts}, num_experts_per_tok={topk}: need 1 <= top-k <= experts")
    if n_group != 1 or topk_group != 1:
        raise ValueError(f"n_group={n_group}, topk_group={topk_group}: only the ungrouped router (1, 1) of "
                         "GLM-5.x is supported")
    return dict(
        num_moe_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe_ffn_hidden_size * n_shared_experts if n_shared_experts else None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=routed_scaling_factor, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
        moe_router_dtype=router_dtype,
    )


def moe_layer_builder(num_experts: int):
    """Megatron's MoE layer (router, local SequentialMLP experts, shared expert), plain-torch modules:
    `builder(config=..., layer_number=..., pg_collection=...)`, or the `mlp` of a TransformerLayer spec."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)


class _Float64Scores(TorchFunctionMode):
    """While active: `Tensor.float()` and float32 dtype arguments give float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: (torch.float64 if v is torch.float32 else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def float64_routing() -> None:
    """Megatron's router takes the sigmoid of float64 logits in float32 (`logits.float()` in
    `topk_routing_with_score_function`): in a float64 run that rounds every routing weight to float32,
    and float64 noise in the logits (a different batch shape) then flips float32 ulps, ~1e-8 apart.
    For float64 logits only, run that function with float32 read as float64; other dtypes are
    untouched (bf16 and float32 models route exactly as Megatron does). Idempotent."""
    import megatron.core.transformer.moe.router as router

    orig = router.topk_routing_with_score_function
    if getattr(orig, "_float64", False):
        return

    def routing(logits, *args, **kwargs):
        if logits.dtype != torch.float64:
            return orig(logits, *args, **kwargs)
        with _Float64Scores():
            return orig(logits, *args, **kwargs)

    routing._float64 = True
    router.topk_routing_with_score_function = routing


def mlp_spec(m, i: int):
    """Layer `i`'s MLP slot: Megatron's SwiGLU `MLP` on a dense layer (m.mlp_types), the sequence-sharded MoE
    otherwise (GLM-5.x and GLM-5.3-Flash)."""
    from functools import partial

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    if m.mlp_types[i] == "dense":
        return partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                      linear_fc2=RowParallelLinear))
    return sequence_sharded_moe_spec(m.n_routed_experts)


def sequence_sharded_moe_spec(num_experts: int):
    """The MoE layer spec of `moe_layer_builder` with `SequenceShardedMoE` as its module (any tp)."""
    from functools import partial

    spec = moe_layer_builder(num_experts)  # partial(MoELayer, submodules=...)
    return partial(_sequence_sharded_moe_class(), *spec.args, **spec.keywords)


_CLASS = None


def _sequence_sharded_moe_class():
    """Built on first use: Megatron is imported only when a model is built."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import dataclasses

    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                        scatter_to_sequence_parallel_region)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class SequenceShardedMoE(MoELayer):
        """Megatron's `MoELayer` in a model that is not sequence parallel, at any tensor-parallel size.

        At tp > 1 Megatron's MoE layer wants its tokens sharded by sequence over the TP group (each TP
        rank routes 1/tp of them; the dispatcher exchanges tokens over EP and the expert-TP group and
        the shared expert gathers them): the layer is built with `sequence_parallel=True` and its input,
        which every TP rank holds whole, is split by sequence (padded to a multiple of tp; padded rows
        are zeros whose outputs are dropped and whose gradients are zero), the output gathered back.
        Backward: the gather hands each rank its own rows' gradient (the layers after it run replicated
        over TP, so every rank holds the same full gradient), the split all-gathers the input gradient.
        The router weight sees only this rank's tokens, so its gradient is summed over TP as autograd
        produces it (a hook on the weight): afterwards it is the full gradient on every TP rank, like
        any replicated parameter, and nothing downstream (DDP, ZeRO-2 shards) treats it specially."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
            self._tp_group = pg_collection.tp
            if self._tp_group.size() > 1:
                config = dataclasses.replace(config, sequence_parallel=True)
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             pg_collection=pg_collection, **kwargs)
            if self._tp_group.size() > 1:
                self.router.weight.register_hook(self._sum_over_tp)

        def _sum_over_tp(self, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=self._tp_group)
            return grad

        def forward(self, hidden_states, *args, **kwargs):
            tp = self._tp_group.size()
            if tp == 1:
                return super().forward(hidden_states, *args, **kwargs)
            T = hidden_states.shape[0]
            if T % tp:
                hidden_states = F.pad(hidden_states, (0, 0, 0, 0, 0, tp - T % tp))
            local = scatter_to_sequence_parallel_region(hidden_states, group=self._tp_group)
            out, bias = super().forward(local, *args, **kwargs)
            full = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=self._tp_group)
            return full[:T], bias

    _CLASS = SequenceShardedMoE
    return _CLASS
