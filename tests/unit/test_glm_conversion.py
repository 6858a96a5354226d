"""GLM-5.x conversion (tools/convert_checkpoint.py): a directory written by transformers'
`GlmMoeDsaForCausalLM.save_pretrained` (bf16, per-expert names as the published checkpoints store them,
the router bias in float32, plus an MTP layer) -> Megatron -> HF is bit-exact for every decoder tensor
(MTP skipped and reported) with config.json given back, and transformers loads the result with the same
logits; bad checkpoints (a missing expert, a router of the wrong size, index_topk = 0) fail with the
tensor or field named before anything is written."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))


def _convert(*argv):
    import convert_checkpoint

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        rc = convert_checkpoint.main(list(argv))
    return rc, out.getvalue() + err.getvalue()


def _files(path):
    from safetensors.torch import load_file

    t = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            t.update(load_file(os.path.join(path, f)))
    return t, json.load(open(os.path.join(path, "config.json")))


def _write(path, tensors, config):
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    json.dump(config, open(os.path.join(path, "config.json"), "w"))


def _worker(rank, world_size, tmp):
    from test_glm_parity import _configs, _hf_model
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M

    hf_cfg, m = _configs(32)
    model = _hf_model(hf_cfg, 3).to(torch.bfloat16)
    for mod in model.modules():  # as transformers keeps it (and the published checkpoints store it): float32
        if "e_score_correction_bias" in mod._buffers:
            mod._buffers["e_score_correction_bias"] = mod._buffers["e_score_correction_bias"].float()
    src = f"{tmp}/hf"
    model.save_pretrained(src)
    tensors, config = _files(src)
    out = {"per_expert_on_disk": "model.layers.1.mlp.experts.5.up_proj.weight" in tensors,
           "bias_dtype": tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype}
    tensors["model.layers.4.eh_proj.weight"] = torch.ones(2, 3, dtype=torch.bfloat16)  # an MTP layer
    os.remove(f"{src}/model.safetensors")
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            os.remove(f"{src}/{f}")
    _write(f"{tmp}/hf_mtp", tensors, config)
    out["to_mcore"] = _convert("hf-to-mcore", f"{tmp}/hf_mtp", f"{tmp}/mc")
    out["to_hf"] = _convert("mcore-to-hf", f"{tmp}/mc", f"{tmp}/back")
    back, back_cfg = _files(f"{tmp}/back")
    decoder = {k: v for k, v in tensors.items() if k != "model.layers.4.eh_proj.weight"}
    out["same_keys"] = set(back) == set(decoder)
    out["bit_exact"] = all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in decoder.items())
    out["config_back"] = back_cfg == config
    out["n"] = len(decoder)
    # transformers reads what we wrote: the same logits as the model it came from
    again = M.GlmMoeDsaForCausalLM.from_pretrained(f"{tmp}/back", dtype=torch.bfloat16, attn_implementation="eager")
    again.config._experts_implementation = "eager"  # the per-expert loop, as the original runs
    ids = torch.randint(0, m.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out["logits_equal"] = torch.equal(again(ids).logits, model(ids).logits)

    bad = {}
    no_expert = {k: v for k, v in decoder.items() if ".mlp.experts.4." not in k}
    _write(f"{tmp}/no_expert", no_expert, config)
    router = dict(decoder, **{"model.layers.2.mlp.gate.weight": torch.zeros(5, m.hidden_size, dtype=torch.bfloat16)})
    _write(f"{tmp}/router", router, config)
    _write(f"{tmp}/topk0", decoder, dict(config, index_topk=0))
    for name, argv in {"missing expert": ("hf-to-mcore", f"{tmp}/no_expert", f"{tmp}/o1"),
                       "router shape": ("hf-to-mcore", f"{tmp}/router", f"{tmp}/o2"),
                       "index_topk": ("hf-to-mcore", f"{tmp}/topk0", f"{tmp}/o3")}.items():
        rc, msg = _convert(*argv)
        bad[name] = (rc, msg.strip().splitlines()[-1] if msg.strip() else "", os.path.exists(argv[2]))
    out["bad"] = bad
    return out


def test_glm_hf_megatron_hf_bit_exact_and_bad_checkpoints(tmp_path):
    from longstraw_mcore.launch_local import run_ranks

    out = run_ranks(_worker, 1, str(tmp_path), timeout_s=300)[0]
    print(f"GLM conversion: {out['n']} decoder tensors, bit-exact {out['bit_exact']}, {out['to_mcore'][1].strip()}")
    assert out["per_expert_on_disk"] and out["bias_dtype"] == torch.float32
    assert out["to_mcore"][0] == 0 and out["to_hf"][0] == 0
    assert "skipped 1 tensors" in out["to_mcore"][1] and "model.layers.4.eh_proj.weight" in out["to_mcore"][1]
    assert out["same_keys"] and out["bit_exact"] and out["config_back"] and out["logits_equal"]
    bad = out["bad"]
    for name, (rc, msg, written) in bad.items():
        print(f"  {name}: rc {rc}, {msg}")
        assert rc == 2 and not written, (name, rc, msg, written)
    assert "missing tensor(s) ['model.layers.1.mlp.experts.4.down_proj.weight'" in bad["missing expert"][1]
    assert "model.layers.2.mlp.gate.weight has shape (5, 32), expected (6, 32)" in bad["router shape"][1]
    assert "model.index_topk=0: must be a positive integer" in bad["index_topk"][1]
