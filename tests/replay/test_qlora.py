"""QLoRA (float32, one rank, exact mode): the frozen base stored as NF4 (torchao) or FP8 (e4m3, a float32
scale per 128 weights), measured bytes per base weight <= 0.56 (nf4, scales included) and <= 1.04 (fp8)
on the tiny Qwen model and on a Qwen3.6-27B-sized projection shard;
log-probs and adapter gradients against `peft` on `transformers` holding the dequantized base (the
same numbers a quantized base stands for), full sequences with autograd: log-probs <= 1e-5, gradient
cosine >= 0.9999. Both families (GLM's absorbed kv_b_proj dequantizes where the mixer reads it, its
experts are quantized per expert)."""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from longstraw_mcore.launch_local import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))


def _hf_and_base(family):
    """(transformers model, canonical base tensors, our config, peft targets) in float32."""
    if family == "qwen":
        from hf_reference import build_hf_model, hf_state, tiny_model_config

        from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore

        m = tiny_model_config(dtype="float32")
        hf = build_hf_model(m, seed=7)
        return hf, hf_to_mcore(hf_state(hf), m), m, [t for t in m.projection_shapes() if t != "lm_head"]
    import dataclasses

    from test_glm_parity import _configs, _hf_model

    from longstraw_mcore.checkpoint.glm_dsa import from_transformers_state, hf_to_mcore

    hf_cfg, m = _configs(32)
    m = dataclasses.replace(m, dtype="float32")
    hf = _hf_model(hf_cfg, 5).float()
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return hf, hf_to_mcore(from_transformers_state(hf.state_dict()), m), m, targets


def _worker(rank, world_size):
    from adapter_reference import full_sequence, lora_grads, random_peft
    from test_replay_equivalence import make_group

    import peft.utils.transformers_weight_conversion as conv

    from longstraw_mcore.adapters.attach import attach
    from longstraw_mcore.adapters.peft_io import gather_canonical, read_peft
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import AdapterConfig, GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import run_group

    out = []
    for family in ("qwen", "glm"):
        for kind in ("nf4", "fp8"):
            hf, base, m, targets = _hf_and_base(family)
            fam = get_family(m.family)
            conv._MODEL_TO_CONVERSION_PATTERN.pop(hf.config.model_type, None)  # per-module adapters (GLM's test)
            d = tempfile.mkdtemp(prefix="qlora-")
            random_peft(hf, [t for t in targets if t not in ("gate_proj", "up_proj", "down_proj")] if family == "glm"
                        else targets, r=4, alpha=8.0, seed=3).save_pretrained(d)
            par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
            model = fam.build_model(m, par, "cpu")
            load_full(model, base)
            sites = fam.checkpoint.adapter_sites(m)
            cfg, canon = read_peft(d, sites, AdapterConfig(rank=4, base_dtype=kind))
            canon = {n: (A.float().double(), B.float().double()) for n, (A, B) in canon.items()}
            modules = dict(model.named_modules())
            aset = attach(model, sites, cfg, par, seed=0, canonical=canon, padded_vocab=model.padded_vocab_size)
            quantized = {p: mod for p, mod in modules.items() if hasattr(mod, "qweight")}
            n_weights = sum(mod.qweight.shape[0] * mod.qweight.shape[1] for mod in quantized.values())
            assert quantized and all(mod.weight.numel() == 0 for mod in quantized.values())  # no dense copy kept
            # the reference holds the dequantized base: the numbers the quantized weights stand for
            deq = dict(base)
            for path, mod in quantized.items():
                w = mod.qweight.dequantize(torch.float32)
                if ".local_experts." in path:  # checkpoints stack the experts: [E, out, in]
                    pre, rest = path.split(".local_experts.")
                    e, fc = rest.split(".")
                    key = f"{pre}.experts.{fc}.weight"
                    deq[key] = deq[key].clone()
                    deq[key][int(e)] = w
                else:
                    deq[path + ".weight"] = w
            hf_ref = _hf_and_base(family)[0]
            hf_ref.load_state_dict(_to_transformers(fam, deq, m, hf_ref), strict=True)
            ref_model = random_peft(hf_ref, [t for t in targets if t not in ("gate_proj", "up_proj", "down_proj")]
                                    if family == "glm" else targets, r=4, alpha=8.0, seed=3)
            _copy_adapter(ref_model, canon)
            group = make_group(m, 12, [4, 6], 31)
            gcfg = GRPOConfig()
            fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
            ref_lp = full_sequence(ref_model, group, fn, _Null)
            ref_g = lora_grads(ref_model)
            res, _ = run_group(model, group.prompt, group.responses, fn, ReplayConfig(mode="exact", chunk_len=5))
            g = gather_canonical(aset, par, grads=True)
            num = sum(float((a * b).sum()) for k in ref_g for a, b in zip(g[k], ref_g[k]))
            den = (sum(float((a * a).sum()) for k in ref_g for a in g[k]) *
                   sum(float((b * b).sum()) for k in ref_g for b in ref_g[k])) ** 0.5
            out.append(dict(family=family, kind=kind, bytes_per_weight=aset.base_bytes / n_weights,
                            n_quantized=len(quantized), logp=max(float((r.logprobs - x).abs().max())
                                                                 for r, x in zip(res, ref_lp)),
                            cosine=num / den))
    # bytes at a real shape: a Qwen3.6-27B MLP shard at TP=4 (gate_proj [17408/4, 5120])
    from longstraw_mcore.adapters.quant import QuantizedWeight

    w = torch.randn(4352, 5120, dtype=torch.bfloat16)
    real = {k: QuantizedWeight(w, k, "27b").nbytes() / w.numel() for k in ("nf4", "fp8")}
    return out, real


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _to_transformers(fam, canonical, m, hf):
    """Canonical Megatron tensors -> the transformers model's state dict (GLM: experts fused again)."""
    tensors = fam.checkpoint.mcore_to_hf(canonical, m)
    state = hf.state_dict()
    out = {}
    for name in state:
        if name in tensors:
            out[name] = tensors[name]
        elif name.endswith("mlp.experts.gate_up_proj"):
            pre = name[:-len("gate_up_proj")]
            out[name] = torch.stack([torch.cat([tensors[f"{pre}{e}.gate_proj.weight"], tensors[f"{pre}{e}.up_proj.weight"]])
                                     for e in range(m.n_routed_experts)])
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[:-len("down_proj")]
            out[name] = torch.stack([tensors[f"{pre}{e}.down_proj.weight"] for e in range(m.n_routed_experts)])
        else:
            out[name] = state[name]  # buffers the table does not carry
    return {k: v.to(state[k].dtype) for k, v in out.items()}


def _copy_adapter(peft_model, canon):
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                mod, which = n[len("base_model.model."):].split(".lora_")
                p.copy_(canon[mod][which.startswith("B")])


def test_qlora_nf4_and_fp8_base_equal_the_dequantized_reference():
    out, real = run_ranks(_worker, 1, timeout_s=900)[0]
    print(f"QLoRA bytes per weight on a Qwen3.6-27B gate_proj shard [4352, 5120]: nf4 {real['nf4']:.4f}, "
          f"fp8 {real['fp8']:.4f}")
    assert real["nf4"] <= 0.56 and real["fp8"] <= 1.04, real
    for r in out:
        print(f"QLoRA {r['family']} {r['kind']}: {r['bytes_per_weight']:.4f} bytes per base weight over "
              f"{r['n_quantized']} projections; log-probs vs the dequantized reference {r['logp']:.1e}, adapter "
              f"gradient cosine {r['cosine']:.8f}")
    for r in out:
        if r["family"] == "qwen":  # GLM's tiny projections (44 x 12, ...) pay NF4's padding and small scale blocks
            assert r["bytes_per_weight"] <= (0.56 if r["kind"] == "nf4" else 1.04), r
        assert r["logp"] <= 1e-5 and r["cosine"] >= 0.9999, r


def _tp_worker(rank, world_size):
    """TP=2 (GLM: x EP=2 is not needed; its MoE layer runs sequence parallel at tp=2): the quantized base
    against the same model holding the dequantized shards densely (Megatron's own matmul), exact mode."""
    from adapter_reference import worst
    from test_replay_equivalence import make_group

    import torch.distributed as dist

    from longstraw_mcore.adapters.attach import attach
    from longstraw_mcore.adapters.peft_io import gather_canonical
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import AdapterConfig, GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import run_group

    out = []
    for family in ("qwen", "glm"):
        _, base, m, _ = _hf_and_base(family)
        fam = get_family(m.family)
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=2), device="cpu"))
        sites = fam.checkpoint.adapter_sites(m)
        group = make_group(m, 12, [4, 6], 31)
        gcfg = GRPOConfig()
        fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
        runs, deq = [], {}  # deq: the nf4 run's dequantized shards, for the dense run after it
        for kind in ("nf4", "dense", "original"):
            model = fam.build_model(m, par, "cpu")
            load_full(model, base)
            if kind == "dense":  # the quantized run's dequantized shards, in Megatron's own linears
                with torch.no_grad():
                    for path, mod in model.named_modules():
                        if path in deq:
                            mod.weight.copy_(deq[path])
            cfg = AdapterConfig(rank=4, alpha=8.0, base_dtype="nf4" if kind == "nf4" else "bfloat16",  # (= unquantized)
                                targets=["q_proj", "in_proj_qkv", "out_proj", "gate_proj", "down_proj"]
                                if family == "qwen" else ["q_a_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj"])
            aset = attach(model, sites, cfg, par, seed=5, padded_vocab=model.padded_vocab_size)
            with torch.no_grad():  # a non-zero B, the same on both runs
                for name, lora in aset.items():
                    for b in lora.B.values():
                        b.copy_(0.05 * torch.ones_like(b))
            if kind == "nf4":
                deq = {p: mod.qweight.dequantize() for p, mod in model.named_modules() if hasattr(mod, "qweight")}
            res, _ = run_group(model, group.prompt, group.responses, fn, ReplayConfig(mode="exact", chunk_len=5))
            runs.append(([r.logprobs for r in res], gather_canonical(aset, par, grads=True)))
        if rank == 0:
            (lq, gq), (ld, gd), (lo, _) = runs
            out.append(dict(family=family, logp=max(float((a - b).abs().max()) for a, b in zip(lq, ld)),
                            grad=worst(gq, gd), vs_unquantized=max(float((a - b).abs().max()) for a, b in zip(lq, lo))))
        dist.barrier()
    return out


def test_qlora_under_tp2_equals_the_dense_dequantized_shards():
    out = run_ranks(_tp_worker, 2, timeout_s=900)[0]
    for r in out:
        print(f"QLoRA nf4 at TP=2 {r['family']}: vs Megatron's linears on the dequantized shards: log-probs "
              f"{r['logp']:.1e}, worst adapter grad {r['grad'][0]:.1e}; the unquantized base differs by "
              f"{r['vs_unquantized']:.1e}")
    for r in out:
        assert r["logp"] <= 1e-5 and r["grad"][0] <= 1e-4 and r["vs_unquantized"] > 1e-3, r
