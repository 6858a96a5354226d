"""GLM-5.3-Flash LoRA adapters == `peft` on `transformers`' `Glm5NextForConditionalGeneration` (float64): a random
non-zero adapter on every default target (KDA q/k/v/b/f_a/f_b/g_a/g_b/o, MLA q_a/q_b/kv_a/kv_b/o, the dense MLP's
and the shared experts' gate/up/down through `peft`, by the module paths it sees: `self_attn.forget_gate.f_a_proj`,
...; each routed expert's gate/up/down as its own adapter, added to transformers' fused expert weights by a
parametrization as tests/replay/test_adapter_parity_glm.py does). `peft` targets a regex over the language model
only: the bare names gate_proj / up_proj / down_proj also name the vision tower's modules.

The tiny model of tests/reference/test_glm5_next_parity.py (KDA / MLA full / MLA shared / KDA, 4 streams, sparse
top-k pools of 4, a 1-block vision tower). Exact mode against full sequences with autograd, detached against
transformers' cache, adapter.prompt=frozen against the cache built with the adapter off; log-probs and every
adapter gradient <= 1e-10 at one rank; at 2 ranks EP=2 x DP=2 and PP=2 (stages [1, 3]); at 4 ranks TP=2 x CP=2 (a
KDA head per TP rank, KDA by sequence pieces), through Megatron DDP over the adapters.
QLoRA (nf4, fp8) at one rank: every site's projection quantized, equal to the dense dequantized base.
Also: the sites are exactly transformers' language-model projections (the indexer's aside) and each Megatron
module they name exists; an adapter directory written here loads into `peft` on the VLM with no adapter in the
vision tower, and `adapter-export --merge` equals peft's merge_and_unload.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch

from adapter_reference import check_layouts

from longstraw_mcore.launch_local import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))

# (TP and CP together at 4 ranks; at 2 the expert and the pipeline split: CI time)
LAYOUTS = {1: [dict()], 2: [dict(ep=2), dict(pp=2, pp_layers=[1, 3])], 4: [dict(tp=2, cp=2)]}
R, ALPHA = 2, 8.0  # rank 2: b_proj has as many outputs as KDA heads (2), the smallest target
CHUNK = 5
LM = "model.language_model."
PEFT_TARGETS = (r"model\.language_model\.layers\.\d+\.(self_attn(\.forget_gate)?|mlp(\.shared_experts)?)\."
                r"(q_proj|k_proj|v_proj|b_proj|f_a_proj|f_b_proj|g_a_proj|g_b_proj|o_proj|q_a_proj|q_b_proj|"
                r"kv_a_proj_with_mqa|kv_b_proj|gate_proj|up_proj|down_proj)")
"""Every default target (`projection_shapes` but lm_head) in the language model, as a regex `peft` fully matches."""


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
    for i, layer in enumerate(peft_model.base_model.model.model.language_model.layers):
        if m.mlp_types[i] != "moe":
            continue
        gu, dn = [], []
        for e in range(m.n_routed_experts):
            per = []
            for p, (out, n_in) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                A = (torch.rand(R, n_in, generator=g, dtype=torch.float64) - 0.5).requires_grad_()
                B = (0.1 * torch.randn(out, R, generator=g, dtype=torch.float64)).requires_grad_()
                leaves[f"{LM}layers.{i}.mlp.experts.{e}.{p}"] = (A, B)
                per.append((A, B))
            gu.append(per[:2])
            dn.append(per[2:])
        parametrize.register_parametrization(layer.mlp.experts, "gate_up_proj", _Delta(gu), unsafe=True)
        parametrize.register_parametrization(layer.mlp.experts, "down_proj", _Delta(dn), unsafe=True)
    return leaves


def _linears(hf):
    """transformers' language-model projections {module: (out, in)}, the no-grad indexer's aside, and lm_head."""
    linear = {n: tuple(mod.weight.shape) for n, mod in hf.named_modules()
              if isinstance(mod, torch.nn.Linear) and n.startswith(LM) and ".indexer." not in n}
    return linear | {"lm_head": tuple(hf.lm_head.weight.shape)}


def _check_sites(linear, m, sites, peft_model):
    """The sites are `linear` (_linears) plus one per routed expert and projection, with their shapes; peft adapted
    exactly the non-expert ones but lm_head (none in the vision tower)."""
    plain = {s.name: s.shape for s in sites if s.expert is None}
    assert plain == linear, sorted(set(plain) ^ set(linear))
    experts = [s for s in sites if s.expert is not None]
    assert len(experts) == 3 * m.n_routed_experts * m.mlp_types.count("moe"), len(experts)
    adapted = {n.split(".lora_")[0][len("base_model.model."):] for n, _ in peft_model.named_parameters()
               if "lora_A" in n}
    assert adapted == set(plain) - {"lm_head"}, sorted(adapted ^ (set(plain) - {"lm_head"}))
    return len(sites)


def _reference(m, hf_mod, hf_cfg, groups, gcfg):
    from adapter_reference import cache_path, full_sequence, lora_grads, random_peft
    from hf_reference import LiftFloat32ToFloat64
    from safetensors.torch import load_file, save_file
    from test_glm5_next_parity import _hf_model

    from longstraw_mcore.checkpoint.glm5_next import adapter_sites, from_transformers_state, hf_to_mcore
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn

    with LiftFloat32ToFloat64():
        hf = _hf_model(hf_mod, hf_cfg, 5)
    with torch.no_grad():  # routers that spread the tokens over every expert (each expert's adapter then trains)
        g = torch.Generator().manual_seed(6)
        for i, layer in enumerate(hf.model.language_model.layers):
            if m.mlp_types[i] == "moe":
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g, dtype=torch.float64))
    base = hf_to_mcore(from_transformers_state(hf.state_dict()), m)
    linear = _linears(hf)
    peft_model = random_peft(hf, PEFT_TARGETS, r=R, alpha=ALPHA, seed=3)
    n_sites = _check_sites(linear, m, adapter_sites(m), peft_model)
    leaves = _expert_adapters(peft_model, m, seed=4)
    d = tempfile.mkdtemp(prefix="peft-glm5-next-")
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
        none = [n for n in grads if not any(float(g.abs().max()) > 0 for _, gs in per_group for g in gs[n])]
        assert not none, (case, "no gradient in any group", none)
    print(f"GLM-5.3 reference: {n_sites} sites, {len(ref[('exact', False)][0][1])} adapters")
    return base, d, ref


def _worker(rank, world_size):
    from adapter_reference import compare_layouts
    from test_glm5_next_parity import _configs
    from test_replay_equivalence import make_group

    from longstraw_mcore.config import GRPOConfig

    hf_mod, hf_cfg, m = _configs(4)
    gcfg = GRPOConfig(beta=0.05)
    # prompts of 15 and 10 tokens in chunks of 5: prompt ends inside pools of 4, every context-parallel rank holds
    # tokens of every chunk
    groups = [make_group(m, 15, [4, 1, 6], 21), make_group(m, 10, [3, 5], 22)]
    kept = {}

    def reference():
        kept["base"], kept["dir"], ref = _reference(m, hf_mod, hf_cfg, groups, gcfg)
        return kept["base"], kept["dir"], ref

    rows = compare_layouts(m, groups, gcfg, reference, LAYOUTS[world_size], CHUNK, rank, world_size)
    if world_size > 1:
        return rows
    return rows, [_qlora(m, kept["base"], kept["dir"], groups[0], gcfg, kind) for kind in ("fp8", "nf4")]


def _qlora(m, base, d, group, gcfg, kind):
    """QLoRA (adapter.base_dtype `kind`) against the same adapter on a dense base holding the dequantized weights
    (whose adapters equal peft's above), exact mode, one rank: every projection of every site quantized (KDA's
    too; MLA's absorbed kv_b_proj dequantized where the mixer reads it, the routed experts one by one)."""
    from adapter_reference import worst

    from longstraw_mcore.adapters.attach import attach
    from longstraw_mcore.adapters.peft_io import gather_canonical, read_peft
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import AdapterConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import run_group

    fam = get_family(m.family)
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    sites = fam.checkpoint.adapter_sites(m)
    fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
    runs, deq, projections = [], dict(base), set()
    for base_dtype in (kind, "bfloat16"):  # bfloat16: no quantization (the model's float64)
        model = fam.build_model(m, par, "cpu")
        load_full(model, deq)
        cfg, canon = read_peft(d, sites, AdapterConfig(rank=R, base_dtype=base_dtype))
        aset = attach(model, sites, cfg, par, seed=0, canonical=canon, padded_vocab=model.padded_vocab_size)
        if base_dtype == kind:
            projections = {p.module for s in sites if s.layer is not None for p in s.parts}
            quantized = {p: mod for p, mod in model.named_modules() if hasattr(mod, "qweight")}
            for path, mod in quantized.items():
                w = mod.qweight.dequantize(torch.float64)
                if ".local_experts." in path:  # stacked on the expert axis: [E, out, in]
                    pre, rest = path.split(".local_experts.")
                    e, fc = rest.split(".")
                    key = f"{pre}.experts.{fc}.weight"
                    deq[key] = deq[key].clone()
                    deq[key][int(e)] = w
                else:
                    deq[path + ".weight"] = w
            projections = (projections, set(quantized))
        res, _ = run_group(model, group.prompt, group.responses, fn, ReplayConfig(mode="exact", chunk_len=CHUNK))
        runs.append(([r.logprobs for r in res], gather_canonical(aset, par, grads=True)))
    (lq, gq), (ld, gd) = runs
    moved = max(float((deq[k] - base[k]).abs().max()) for k in base if deq[k] is not base[k])
    return dict(kind=kind, logp=max(float((a - b).abs().max()) for a, b in zip(lq, ld)), grad=worst(gq, gd),
                sites=projections[0], quantized=projections[1], moved=moved)


def test_glm5_next_lora_one_rank_equals_peft():
    rows, qlora = run_ranks(_worker, 1, timeout_s=600)[0]
    check_layouts(rows, "GLM-5.3 ")
    for r in qlora:
        print(f"GLM-5.3 QLoRA {r['kind']}: {len(r['quantized'])} projections quantized (weights moved by up to "
              f"{r['moved']:.1e}); vs the dequantized dense base: log-probs {r['logp']:.1e}, worst adapter grad "
              f"{r['grad'][0]:.1e} ({r['grad'][1]})")
        assert r["quantized"] == r["sites"], sorted(r["quantized"] ^ r["sites"])[:4]
        assert r["moved"] > 1e-4 and r["logp"] <= 1e-12 and r["grad"][0] <= 1e-10, r


def test_glm5_next_lora_ep2_pp2_equal_peft():
    check_layouts(run_ranks(_worker, 2, timeout_s=900)[0], "GLM-5.3 ")


def test_glm5_next_lora_tp2_x_cp2_equals_peft():
    check_layouts(run_ranks(_worker, 4, timeout_s=1200)[0], "GLM-5.3 ")


def test_glm5_next_adapter_export_loads_into_peft_and_merges_as_peft(tmp_path):
    """An adapter directory as this project writes it (adapters/peft_io.write_peft, every default target incl. the
    routed experts) loads into `peft` on the VLM with its factors in place and no adapter in the vision tower (the
    bare target names gate/up/down_proj name vision modules too: `exclude_modules` keeps them out); `adapter-export
    --merge` (adapters/merge.py) equals peft's merge_and_unload tensor for tensor (the forget gate's f_a / f_b under
    their stored names), each routed expert's stored weight W + (alpha / r) B A, the vision tower untouched."""
    import json

    from hf_reference import LiftFloat32ToFloat64
    from peft import PeftModel
    from safetensors.torch import load_file
    from test_glm5_next_parity import _configs, _hf_model

    from longstraw_mcore.adapters.merge import merge_into_hf
    from longstraw_mcore.adapters.peft_io import write_peft
    from longstraw_mcore.checkpoint.glm5_next import adapter_sites, from_transformers_state
    from longstraw_mcore.config import AdapterConfig
    from longstraw_mcore.families import get_family

    hf_mod, hf_cfg, m = _configs(4)
    with LiftFloat32ToFloat64():
        hf = _hf_model(hf_mod, hf_cfg, 5)
    hf.save_pretrained(tmp_path / "base")
    cfg = AdapterConfig(rank=R, alpha=ALPHA)
    targets = cfg.resolved_targets(m.projection_shapes())
    g = torch.Generator().manual_seed(11)
    sites = {s.name: s for s in adapter_sites(m) if s.target in targets}
    tensors = {n: (torch.randn(R, s.shape[1], generator=g, dtype=torch.float64),
                   torch.randn(s.shape[0], R, generator=g, dtype=torch.float64)) for n, s in sites.items()}
    d = write_peft(tmp_path / "adapter", tensors, cfg, targets)
    vision = [n for n, mod in hf.named_modules() if n.startswith("model.visual.") and isinstance(mod, torch.nn.Linear)
              and n.rsplit(".", 1)[-1] in targets]
    assert vision and json.loads((d / "adapter_config.json").read_text())["exclude_modules"]
    peft_model = PeftModel.from_pretrained(hf, str(d))
    loaded = {}
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            mod, which = n[len("base_model.model."):].split(".lora_")
            loaded.setdefault(mod, [None, None])[which.startswith("B")] = p.detach()
    plain = {n for n, s in sites.items() if s.expert is None}
    assert set(loaded) == plain, sorted(set(loaded) ^ plain)
    assert all(torch.equal(loaded[n][i], tensors[n][i]) for n in plain for i in (0, 1))
    n_merged = merge_into_hf(get_family("glm5_next"), tmp_path / "base", d, tmp_path / "merged", log=print)
    ours = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(tmp_path / "base" / "model.safetensors"))
    want = dict(from_transformers_state({k: v.detach() for k, v in peft_model.merge_and_unload().state_dict().items()}))
    for n, s in sites.items():
        if s.expert is not None:  # peft has no per-expert module on transformers' fused experts
            A, B = tensors[n]
            want[n + ".weight"] = base[n + ".weight"] + ALPHA / R * B @ A
    stored = {s.weight or s.name + ".weight" for s in sites.values()}
    assert n_merged == len(sites) and stored <= set(ours), (n_merged, len(sites), sorted(stored - set(ours))[:3])
    assert any(".self_attn.f_a_proj.weight" in k for k in stored)
    worst = max(float((ours[k] - want[k]).abs().max() / want[k].abs().max()) for k in stored)
    print(f"GLM-5.3 adapter export: {len(plain)} modules loaded into peft (none of {len(vision)} vision "
          f"projections), {n_merged} weights merged, worst vs peft's merge {worst:.1e}")
    assert worst <= 1e-14
    assert all(torch.equal(ours[k], base[k]) for k in base if k.startswith("model.visual.")) and \
        any(k.startswith("model.visual.") for k in ours)
