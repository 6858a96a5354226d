"""GLM-5.x LoRA adapters == `peft` on `transformers` (float64): a random non-zero adapter on every default
target (MLA q_a/q_b/kv_a/kv_b/o projections, the dense MLP's and the shared expert's gate/up/down
through `peft`; each routed expert's gate/up/down as its own adapter). transformers fuses the routed
experts into 3-D parameters that `peft` cannot adapt per module, so there the reference adds the
adapter to transformers' expert weights, W_e + (alpha/r) B_e A_e, through a parametrization
(what a LoRA is, run by transformers' expert loop). Exact mode against full sequences with autograd,
detached against the cache path, adapter.prompt=frozen against the cache built with the adapter off;
log-probs and every adapter gradient <= 1e-10 at one rank, TP=2 x CP=2, TP=2 x EP=2 and PP=2 x DP=2,
through Megatron DDP over the adapters (the kv_b_proj adapter acts on the absorbed weight)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch

from adapter_reference import check_layouts

from longstraw_mcore.launch_local import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))

LAYOUTS = {1: [dict()], 4: [dict(tp=2, cp=2), dict(tp=2, ep=2), dict(pp=2, pp_layers=[1, 3])]}
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA = 4, 8.0
CHUNK = 5


class _Delta(torch.nn.Module):
    """W [E, out, in] -> W + s [B_e A_e] (gate_up: the gate rows then the up rows)."""

    on = True  # off while adapter.prompt=frozen's reference builds its prompt cache

    def __init__(self, pairs):
        super().__init__()
        self.pairs = pairs  # per expert: [(A, B), ...] stacked along the output rows

    @classmethod
    @contextlib.contextmanager
    def off(cls):
        cls.on = False
        try:
            yield
        finally:
            cls.on = True

    def forward(self, W):
        if not self.on:
            return W
        return W + torch.stack([torch.cat([ALPHA / R * B @ A for A, B in per], 0) for per in self.pairs])


def _expert_adapters(peft_model, m, seed):
    """Random per-expert adapters parametrizing transformers' fused expert weights; {name: (A, B)} leaves."""
    from torch.nn.utils import parametrize

    g = torch.Generator().manual_seed(seed)
    H, I = m.hidden_size, m.moe_intermediate_size
    leaves = {}
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        if m.mlp_types[i] != "moe":
            continue
        experts = layer.mlp.experts
        gu, dn = [], []
        for e in range(m.n_routed_experts):
            per = []
            for p, (out, n_in) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                A = (torch.rand(R, n_in, generator=g, dtype=torch.float64) - 0.5).requires_grad_()
                B = (0.1 * torch.randn(out, R, generator=g, dtype=torch.float64)).requires_grad_()
                leaves[f"model.layers.{i}.mlp.experts.{e}.{p}"] = (A, B)
                per.append((A, B))
            gu.append(per[:2])
            dn.append(per[2:])
        parametrize.register_parametrization(experts, "gate_up_proj", _Delta(gu), unsafe=True)
        parametrize.register_parametrization(experts, "down_proj", _Delta(dn), unsafe=True)
    return leaves


def _reference(m, hf_cfg, groups, gcfg):
    from adapter_reference import cache_path, full_sequence, lora_grads, random_peft
    from hf_reference import LiftFloat32ToFloat64
    from safetensors.torch import load_file, save_file
    from test_glm_parity import _hf_model

    from longstraw_mcore.checkpoint.glm_dsa import from_transformers_state, hf_to_mcore
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn

    with LiftFloat32ToFloat64():
        hf = _hf_model(hf_cfg, 5)
    base = hf_to_mcore(from_transformers_state(hf.state_dict()), m)
    # peft would turn gate/up/down targets into its own fused LoRA over transformers' 3-D expert
    # parameters (one adapter over all experts' gate_up): not the per-module adapters of the stored
    # layout, which the parametrization below gives; so peft adapts the nn.Linear modules only here
    import peft.utils.transformers_weight_conversion as conv

    fused = conv._MODEL_TO_CONVERSION_PATTERN.pop(hf.config.model_type, None)
    try:
        peft_model = random_peft(hf, TARGETS, r=R, alpha=ALPHA, seed=3)
    finally:
        if fused is not None:
            conv._MODEL_TO_CONVERSION_PATTERN[hf.config.model_type] = fused
    leaves = _expert_adapters(peft_model, m, seed=4)
    d = tempfile.mkdtemp(prefix="peft-glm-")
    peft_model.save_pretrained(d)
    st = os.path.join(d, "adapter_model.safetensors")
    flat = load_file(st)
    for name, (A, B) in leaves.items():
        flat[f"base_model.model.{name}.lora_A.weight"] = A.detach()
        flat[f"base_model.model.{name}.lora_B.weight"] = B.detach()
    save_file(flat, st)
    ref = {}
    for case in (("exact", False), ("detached", False), ("detached", True)):
        per_group = []
        for group in groups:
            fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
            peft_model.zero_grad(set_to_none=True)
            for A, B in leaves.values():
                A.grad = B.grad = None
            if case == ("exact", False):
                lp = full_sequence(peft_model, group, fn, LiftFloat32ToFloat64)
            else:
                lp = cache_path(peft_model, group, fn, LiftFloat32ToFloat64, frozen_prompt=case[1], also_off=_Delta.off)
            grads = lora_grads(peft_model)
            grads.update({n: tuple(x.grad.clone() for x in ab) for n, ab in leaves.items()})
            per_group.append((lp, grads))
        ref[case] = per_group
    return base, d, ref


def _worker(rank, world_size):
    from adapter_reference import compare_layouts
    from test_glm_parity import _configs
    from test_replay_equivalence import make_group

    from longstraw_mcore.config import GRPOConfig

    hf_cfg, m = _configs(4)
    gcfg = GRPOConfig(beta=0.05)
    # prompts of 16 and 11 tokens in chunks of 5: every context-parallel rank holds tokens of every chunk
    groups = [make_group(m, 16, [4, 1, 6], 21), make_group(m, 11, [3, 5], 22)]
    return compare_layouts(m, groups, gcfg, lambda: _reference(m, hf_cfg, groups, gcfg), LAYOUTS[world_size], CHUNK,
                           rank, world_size)


def test_glm_lora_one_rank_equals_peft():
    check_layouts(run_ranks(_worker, 1, timeout_s=600)[0], "GLM ")


def test_glm_lora_tp_cp_ep_and_pp_equal_peft():
    check_layouts(run_ranks(_worker, 4, timeout_s=1200)[0], "GLM ")
