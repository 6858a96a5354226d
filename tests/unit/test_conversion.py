"""tools/convert_checkpoint.py: HF -> Megatron -> HF is bit-exact for every tensor (dtypes kept,
config.json given back), the published multimodal form is accepted (vision tower / MTP skipped and
reported), converted checkpoints load at TP=2 x PP=2 with the reference's logits, and bad input
fails with a clear error before anything is written."""

from __future__ import annotations

import json
import os

import torch

from longstraw_mcore.launch_local import run_ranks


def _save_hf_dir(path, tensors, config):
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _read_dir(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors")), json.load(open(os.path.join(path, "config.json")))


def _convert(*argv):
    import convert_checkpoint

    return convert_checkpoint.main(list(argv))


def _worker(rank, world_size, tmp):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tools"))
    from hf_reference import build_hf_model, hf_state, tiny_model_config

    from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint, save_full_tensors
    from longstraw_mcore.checkpoint.qwen3_5 import CheckpointError, hf_to_mcore

    out = {}
    m = tiny_model_config(dtype="float32")
    hf = build_hf_model(m, seed=1).to(torch.bfloat16)
    # 1) the real HF writer, bf16, plus one tensor kept in float32 (as published checkpoints keep A_log)
    src = f"{tmp}/hf"
    hf.save_pretrained(src)
    tensors, config = _read_dir(src)
    tensors["model.layers.0.linear_attn.A_log"] = tensors["model.layers.0.linear_attn.A_log"].float() + 1e-3
    os.remove(f"{src}/model.safetensors")
    from safetensors.torch import save_file

    save_file(tensors, f"{src}/model.safetensors")
    out["rc_to_mcore"] = _convert("hf-to-mcore", src, f"{tmp}/mc", "--tp", "2", "--pp", "2")
    out["rc_to_hf"] = _convert("mcore-to-hf", f"{tmp}/mc", f"{tmp}/back")
    back, back_cfg = _read_dir(f"{tmp}/back")
    out["same_keys"] = set(back) == set(tensors)
    out["bit_exact"] = all(back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k]) for k in tensors)
    out["config_back"] = back_cfg == config
    out["n_tensors"] = len(tensors)

    # 2) the published multimodal form: decoder under model.language_model.*, nested text_config
    mm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in tensors.items()}
    mm["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    mm["mtp.fc.weight"] = torch.zeros(2, 2)
    mm_cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {k: v for k, v in config.items() if k not in ("architectures",)},
              "vision_config": {"depth": 1}}
    _save_hf_dir(f"{tmp}/mm", mm, mm_cfg)
    out["rc_mm"] = _convert("hf-to-mcore", f"{tmp}/mm", f"{tmp}/mc_mm")
    _convert("mcore-to-hf", f"{tmp}/mc_mm", f"{tmp}/mm_back")
    mm_back, _ = _read_dir(f"{tmp}/mm_back")
    out["mm_text_bit_exact"] = set(mm_back) == set(tensors) and all(torch.equal(mm_back[k], tensors[k]) for k in tensors)

    # 3) bad input: nothing may be written
    bad = {}
    _save_hf_dir(f"{tmp}/llama", {"x": torch.zeros(1)}, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    missing = dict(tensors)
    missing.pop("model.layers.1.self_attn.k_proj.weight")
    _save_hf_dir(f"{tmp}/missing", missing, config)
    wrong = dict(tensors)
    wrong["model.layers.2.mlp.down_proj.weight"] = torch.zeros(3, 5)
    _save_hf_dir(f"{tmp}/wrong", wrong, config)
    for name, argv in {"arch": ("hf-to-mcore", f"{tmp}/llama", f"{tmp}/o1"),
                       "missing": ("hf-to-mcore", f"{tmp}/missing", f"{tmp}/o2"),
                       "shape": ("hf-to-mcore", f"{tmp}/wrong", f"{tmp}/o3"),
                       "tp": ("hf-to-mcore", src, f"{tmp}/o4", "--tp", "3"),
                       "overwrite": ("mcore-to-hf", f"{tmp}/mc", f"{tmp}/back")}.items():
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = _convert(*argv)
        bad[name] = (rc, err.getvalue().strip(), os.path.exists(argv[2]) and name != "overwrite")
    out["bad"] = bad

    # 4) a Megatron checkpoint missing a tensor: load fails naming it, before touching the model
    from longstraw_mcore.config import ParallelConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel

    m64 = tiny_model_config()
    full = hf_to_mcore(hf_state(build_hf_model(m64, seed=2)), m64)
    full.pop("decoder.layers.2.self_attention.in_proj_z.weight")
    save_full_tensors(full, f"{tmp}/mc_missing", m64)
    par = setup_parallel(RunConfig(model=m64, parallel=ParallelConfig(), device="cpu"))
    model = build_model(m64, par, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    try:
        load_checkpoint(model, f"{tmp}/mc_missing")
        out["mc_missing"] = "no error"
    except CheckpointError as e:
        out["mc_missing"] = str(e)
    out["mc_missing_untouched"] = all(torch.equal(before[k], model.state_dict()[k]) for k in before)
    return out


def test_round_trip_forms_and_bad_input(tmp_path):
    out = run_ranks(_worker, 1, str(tmp_path), timeout_s=600)[0]
    print({k: v for k, v in out.items() if k != "bad"})
    for k, v in out["bad"].items():
        print(f"bad input {k}: rc={v[0]} wrote={v[2]} :: {v[1]}")
    assert out["rc_to_mcore"] == 0 and out["rc_to_hf"] == 0 and out["rc_mm"] == 0
    assert out["same_keys"] and out["bit_exact"] and out["config_back"], out
    assert out["mm_text_bit_exact"]
    bad = out["bad"]
    assert all(rc == 2 and not wrote for rc, _, wrote in bad.values()), bad
    assert "architecture ['LlamaForCausalLM'] is not supported" in bad["arch"][1]
    assert "missing tensor(s) ['model.layers.1.self_attn.k_proj.weight']" in bad["missing"][1]
    assert "model.layers.2.mlp.down_proj.weight has shape (3, 5), expected (48, 80)" in bad["shape"][1]
    assert "model.num_attention_heads=4 is not divisible by parallel.tp=3" in bad["tp"][1]
    assert "exists and is not empty; refusing to overwrite" in bad["overwrite"][1]
    assert "decoder.layers.2.self_attention.in_proj_z.weight" in out["mc_missing"]
    assert out["mc_missing_untouched"]


def _layout_worker(rank, world_size, tmp):
    from hf_reference import LiftFloat32ToFloat64, build_hf_model, tiny_model_config

    from longstraw_mcore.checkpoint.convert import load_hf_into_model
    from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint
    from longstraw_mcore.config import ParallelConfig, RunConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.models.language_model import gather_vocab
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.pipeline import forward_backward

    m = tiny_model_config()
    with LiftFloat32ToFloat64():
        hf = build_hf_model(m, seed=4)
        ids = torch.randint(0, m.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        ref = hf(input_ids=ids).logits.detach()
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=2, pp=2), device="cpu"))
    logits = {}
    for how in ("hf", "mcore"):
        model = build_model(m, par, "cpu")
        load_hf_into_model(get_family(m.family), model, f"{tmp}/hf", expect=m) if how == "hf" else load_checkpoint(model, f"{tmp}/mc")
        res = forward_backward(model, par, [ids], lambda lg: (lg.sum() * 0, {"logits": gather_vocab(
            lg, par.pgs.tp).detach().clone()}), forward_only=True)
        logits[how] = res[0]["logits"]
    return (float((logits["hf"] - ref).abs().max() / ref.abs().max()), torch.equal(logits["hf"], logits["mcore"]))


def _convert_worker(rank, world_size, tmp):
    from hf_reference import LiftFloat32ToFloat64, build_hf_model, tiny_model_config

    from longstraw_mcore.checkpoint.convert import hf_to_mcore_dir
    from longstraw_mcore.families import get_family

    with LiftFloat32ToFloat64():
        hf = build_hf_model(tiny_model_config(), seed=4)
    hf.save_pretrained(f"{tmp}/hf")
    hf_to_mcore_dir(get_family("qwen3_5"), f"{tmp}/hf", f"{tmp}/mc", tp=2, pp=2, log=lambda *_: None)


def test_converted_checkpoint_loads_at_tp2_pp2(tmp_path):
    run_ranks(_convert_worker, 1, str(tmp_path), timeout_s=300)  # the converter is a one-process job
    results = run_ranks(_layout_worker, 4, str(tmp_path), timeout_s=600)
    for err, same in results:
        print(f"TP=2 x PP=2 from --hf: logits rel {err:.2e} vs the reference; from the converted checkpoint "
              f"bit-identical: {same}")
        assert err <= 1e-6 and same
