"""GLM-5.3-Flash's checkpoint table (checkpoint/glm5_next.py) against what transformers' `save_pretrained` writes for a
tiny `Glm5NextForConditionalGeneration` (4 layers KDA / MLA full / MLA shared / KDA, dense then MoE of 4 experts,
4 streams, pools of 4, a 1-block vision tower; random weights; loaded back in bf16 so that transformers keeps its
float32 modules, as the published checkpoints hold them): the table's HF names and shapes are exactly the saved
decoder tensors, the vision tower and MTP are exactly the skipped ones, `from_transformers_state` of the VLM's (and
the text model's) in-memory state equals the saved tensors bit for bit, HF -> Megatron -> HF is bit-exact with the
Megatron names and shapes the model uses (a lazy rank's slice too), and config.json reads back, is written back
(with and without the recorded one; transformers reads both) and its unsupported settings are refused by name.
Export keeps the VLM (checkpoint/passthrough.py): HF -> Megatron checkpoint -> HF gives back every tensor but the
MTP layers bit for bit and config.json equal, which transformers loads (no missing or unexpected key) into the same
model (same logits, bit for bit); a failed write leaves nothing; an adapter merge writes the same set and config."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from longstraw_mcore.bench.hf_kernels import glm5_next_modeling
from longstraw_mcore.checkpoint import glm5_next as G
from longstraw_mcore.checkpoint.common import CheckpointError
from longstraw_mcore.checkpoint.hf import read_tensors

H, V, F, I, E, N = 32, 64, 48, 16, 4, 4          # hidden, vocab, dense FFN, expert FFN, experts, streams
NH, Q, R, DN, DV = 2, 12, 10, 8, 6                 # MLA heads, q LoRA, kv LoRA, no-RoPE and value head dims
HI, DI, KP = 3, 8, 4                               # indexer heads and head dim, pool
LH, K, W = 2, 8, 3                                 # KDA heads, head dim, conv kernel
D = LH * K
TEXT = dict(vocab_size=V, hidden_size=H, intermediate_size=F, moe_intermediate_size=I, num_hidden_layers=4,
            num_attention_heads=NH, num_key_value_heads=NH, n_shared_experts=1, n_routed_experts=E,
            num_experts_per_tok=2, kv_lora_rank=R, q_lora_rank=Q, qk_nope_head_dim=DN, v_head_dim=DV, index_topk=8,
            index_head_dim=DI, index_n_heads=HI, index_kpool=KP, linear_head_dim=K, linear_num_heads=LH,
            linear_conv_kernel_dim=W, hc_mult=N, pad_token_id=None,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=H,
              projection_intermediate_size=40, patch_size=2, spatial_merge_size=2, temporal_patch_size=2, image_size=8)
MTP = ["model.language_model.layers.4.eh_proj.weight", "model.language_model.layers.4.shared_head.norm.weight"]
FP32 = ("hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale", "self_attn.A_log", "self_attn.dt_bias",
        "self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight",
        "mlp.gate.e_score_correction_bias")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model loaded in bf16, its save_pretrained directory, the saved tensors, the saved config.json)."""
    from safetensors.torch import load_file

    hf = glm5_next_modeling(fla=False)
    torch.manual_seed(0)
    model = hf.Glm5NextForConditionalGeneration(hf.Glm5NextConfig(text_config=TEXT, vision_config=VISION))
    with torch.no_grad():  # every tensor distinct (HF's constant inits perturbed): a swapped name shows
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            t.copy_(torch.randn(t.shape))
    first, src = tmp_path_factory.mktemp("fp32"), tmp_path_factory.mktemp("bf16")
    model.save_pretrained(first)
    model = hf.Glm5NextForConditionalGeneration.from_pretrained(first, dtype=torch.bfloat16)
    model.save_pretrained(src)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return model, src, tensors, json.loads((src / "config.json").read_text())


def _mcore_shapes() -> dict:
    """The Megatron names and shapes of models/glm5_next.py (written out here, not derived from the table)."""
    out = {"embedding.word_embeddings.weight": (V, H), "decoder.final_layernorm.weight": (H,),
           "output_layer.weight": (V, H)}
    for i in range(4):
        g = f"decoder.layers.{i}."
        s = g + "self_attention."
        for norm in ("input_layernorm.", "pre_mlp_layernorm."):
            out |= {g + norm + "weight": (H,), g + norm + "hc.fn": ((N + 2) * N, N * H),
                    g + norm + "hc.base": ((N + 2) * N,), g + norm + "hc.scale": (3,)}
        if i in (0, 3):
            out |= {s + "q_proj.weight": (D, H), s + "k_proj.weight": (D, H), s + "v_proj.weight": (D, H),
                    s + "conv_q": (D, W), s + "conv_k": (D, W), s + "conv_v": (D, W), s + "f_a_proj.weight": (K, H),
                    s + "f_b_proj.weight": (D, K), s + "A_log": (LH,), s + "dt_bias": (D,),
                    s + "b_proj.weight": (LH, H),
                    s + "g_a_proj.weight": (K, H), s + "g_b_proj.weight": (D, K), s + "o_norm.weight": (K,),
                    s + "o_proj.weight": (H, D)}
        else:
            out |= {s + "q_a_proj.weight": (Q, H), s + "q_a_layernorm.weight": (Q,),
                    s + "q_b_proj.weight": (NH * DN, Q),
                    s + "kv_a_proj_with_mqa.weight": (R, H), s + "kv_a_layernorm.weight": (R,),
                    s + "kv_b_proj.weight": (NH * (DN + DV), R), s + "o_proj.weight": (H, NH * DV)}
        if i == 1:
            x = s + "indexer."
            out |= {x + "wq_b.weight": (HI * DI, Q), x + "wk.weight": (DI, H), x + "k_norm.weight": (DI,),
                    x + "k_norm.bias": (DI,), x + "weights_proj.weight": (HI, H), x + "kpool_ape": (KP, DI),
                    x + "kpool_gate": (DI, H)}
        if i == 0:
            out |= {g + "mlp.linear_fc1.weight": (2 * F, H), g + "mlp.linear_fc2.weight": (H, F)}
        else:
            out |= {g + "mlp.router.weight": (E, H), g + "mlp.router.expert_bias": (E,),
                    g + "mlp.experts.experts.linear_fc1.weight": (E, 2 * I, H),
                    g + "mlp.experts.experts.linear_fc2.weight": (E, H, I),
                    g + "mlp.shared_experts.linear_fc1.weight": (2 * I, H),
                    g + "mlp.shared_experts.linear_fc2.weight": (H, I)}
    return out


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:8]
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not bad, bad[:8]


def test_table_names_shapes_skips_and_dtypes(saved):
    _, src, tensors, _ = saved
    m, _ = G.read_config(src)
    skipped = G.skipped_names(list(tensors) + MTP, m)
    vision = [k for k in tensors if k.startswith("model.visual.")]
    assert vision and sorted(skipped) == sorted(vision + MTP)
    decoder = {k: tuple(t.shape) for k, t in tensors.items() if k not in skipped}
    assert decoder == G.hf_shapes(m)
    assert {k for r in G.rules(m) for k in r.hf} == set(decoder)  # every saved decoder tensor has exactly one rule
    assert sum(len(r.hf) for r in G.rules(m)) == len(decoder)
    fp32 = {k for k, t in tensors.items() if t.dtype == torch.float32}
    assert fp32 == {k for k in decoder if k.endswith(FP32)}, sorted(fp32)  # _keep_in_fp32_modules_strict
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if k not in fp32)
    with pytest.raises(CheckpointError, match="layers.3.self_attn.v_conv1d.weight"):
        G.check_hf_tensors({k: t for k, t in tensors.items() if not k.endswith("3.self_attn.v_conv1d.weight")}, m)


def test_from_transformers_state_equals_saved(saved):
    model, _, tensors, _ = saved
    state = model.state_dict()
    ours = G.from_transformers_state(state)
    _same(ours, tensors)
    conv = state["model.language_model.layers.0.self_attn.conv1d.weight"]  # views, no copies
    assert ours["model.language_model.layers.0.self_attn.k_conv1d.weight"].data_ptr() == conv[D:].data_ptr()
    text = G.from_transformers_state(model.model.language_model.state_dict())  # Glm5NextTextModel's names
    _same(text, {k: t for k, t in tensors.items() if k.startswith(G.LM)})
    _same(G.from_transformers_state(model.model.state_dict()),  # Glm5NextModel's
          {k: t for k, t in tensors.items() if k != "lm_head.weight"})


def test_round_trip_bit_exact(saved):
    _, src, tensors, _ = saved
    m, _ = G.read_config(src)
    decoder = {k: t for k, t in tensors.items() if k in G.hf_shapes(m)}
    mc = G.hf_to_mcore(decoder, m)
    assert {k: tuple(t.shape) for k, t in mc.items()} == _mcore_shapes()
    assert mc["decoder.layers.0.self_attention.conv_v"].dtype == torch.float32
    assert torch.equal(mc["decoder.layers.0.self_attention.conv_k"],
                       tensors["model.language_model.layers.0.self_attn.k_conv1d.weight"][:, 0])
    assert torch.equal(mc["decoder.layers.1.input_layernorm.hc.fn"],
                       tensors["model.language_model.layers.1.hc_attn_fn"])
    _same(G.mcore_to_hf(mc, m), decoder)
    lazy = G.LazyCanonical(read_tensors(src, G.tensor_name)[0], m, where=str(src))  # a rank's slice, read lazily
    for key, sl in (("decoder.layers.3.self_attention.conv_q", (slice(8, 16), slice(0, W))),
                    ("decoder.layers.2.mlp.experts.experts.linear_fc1.weight",
                     (slice(1, 3), slice(0, 2 * I), slice(0, 16))),
                    ("decoder.layers.1.self_attention.indexer.kpool_gate", (slice(2, 6), slice(0, H)))):
        assert lazy.shape(key) == tuple(mc[key].shape)
        assert torch.equal(lazy.read(key, sl), mc[key][sl]), key


def _write(tmp_path, name, raw):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_config_read_written_back_and_refused(saved, tmp_path):
    hf = glm5_next_modeling(fla=False)
    _, src, _, raw = saved
    m, got_raw = G.read_config(src)
    assert got_raw == raw and not G.config_is_decoder_only(raw)
    assert (m.mixer_types, m.indexer_types, m.mlp_layer_types) == (TEXT["layer_types"], TEXT["indexer_types"],
                                                                    TEXT["mlp_layer_types"])
    assert m.layer_types == ["kda", "mla_dsa_full", "mla_dsa_shared", "kda"]
    assert (m.hc_mult, m.index_kpool, m.linear_num_heads, m.linear_head_dim, m.linear_conv_kernel_dim,
            m.linear_lower_bound, m.dtype) == (N, KP, LH, K, W, -5.0, "bfloat16")
    assert G.hf_config_dict(m, raw) == raw  # the recorded config.json given back whole
    bare = G.hf_config_dict(m)
    again, _ = G.read_config(_write(tmp_path, "bare", bare))
    assert again.architecture() == m.architecture() and again.dtype == m.dtype
    cfg = hf.Glm5NextConfig.from_dict(bare)  # transformers reads it: its default vision tower
    assert cfg.vision_config.depth == hf.Glm5NextVisionConfig().depth
    assert all(getattr(cfg.text_config, k) == v for k, v in bare["text_config"].items()), bare["text_config"]
    defaults = hf.Glm5NextTextConfig()
    assert all(getattr(defaults, k) == v for k, v in G._DEFAULTS.items())

    def text_cfg(**change):
        r = copy.deepcopy(raw)
        for k, v in change.items():
            if v is None:
                r["text_config"].pop(k, None)
            else:
                r["text_config"][k] = v
        return r

    # derived lists and linear_attn_config, as transformers derives them
    for i, change in enumerate((dict(indexer_types=None, index_topk_pattern="FFSF"),
                                dict(indexer_types=None, index_topk_freq=2, index_skip_topk_offset=2),
                                dict(layer_types=None, num_hidden_layers=4, indexer_types=["full"] * 4),
                                dict(linear_attn_config={"head_dim": 4, "num_heads": 4, "short_conv_kernel_size": 2,
                                                         "gate_lower_bound": None, "safe_gate": True}),
                                dict(linear_attn_config={"gate_lower_bound": None, "safe_gate": False}))):
        r = text_cfg(**change)
        ours, _ = G.read_config(_write(tmp_path, f"derived{i}", r))
        theirs = hf.Glm5NextConfig.from_dict(r).text_config
        assert (ours.mixer_types, ours.indexer_types, ours.mlp_layer_types, ours.linear_head_dim, ours.linear_num_heads,
                ours.linear_conv_kernel_dim, ours.linear_lower_bound) == (
            theirs.layer_types, theirs.indexer_types, theirs.mlp_layer_types, theirs.linear_head_dim,
            theirs.linear_num_heads, theirs.linear_conv_kernel_dim, theirs.linear_lower_bound), change
        assert G.read_config(_write(tmp_path, f"back{i}", G.hf_config_dict(ours, r)))[0] == ours

    refused = {"tie": ({**raw, "tie_word_embeddings": True}, "tie_word_embeddings"),
               "tie_text": (text_cfg(tie_word_embeddings=True), "tie_word_embeddings"),
               "group": (text_cfg(n_group=2), "n_group=2"), "rope": (text_cfg(qk_rope_head_dim=16), "qk_rope_head_dim"),
               "tail": (text_cfg(index_kpool_always_select_tail=False), "index_kpool_always_select_tail"),
               "act": (text_cfg(hidden_act="gelu"), "hidden_act"),
               "kv": (text_cfg(num_key_value_heads=1), "num_key_value_heads"),
               "types": (text_cfg(layer_types=["linear_attention"] * 3 + ["mamba"]), "layer_types"),
               "pattern": (text_cfg(indexer_types=None, index_topk_pattern="FFXF"), "index_topk_pattern"),
               "shared_after_kda": (text_cfg(indexer_types=None, index_topk_freq=2, index_skip_topk_offset=1),
                                    "indexer_types"),
               "missing": (text_cfg(kv_lora_rank=None), "kv_lora_rank"),
               "arch": ({**raw, "architectures": ["GlmMoeDsaForCausalLM"]}, "GlmMoeDsaForCausalLM")}
    for name, (r, key) in refused.items():
        with pytest.raises(CheckpointError, match=key):
            G.read_config(_write(tmp_path, name, r))


# ---------------------------------------------------------------------------------------------
# export: the VLM's form (checkpoint/passthrough.py)


def _with_mtp(saved, tmp_path) -> Path:
    """The saved directory plus a second file of MTP tensors (as the published checkpoints hold, which
    transformers ignores): dropped on export."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    shutil.copytree(saved[1], src)
    g = torch.Generator().manual_seed(1)
    save_file({MTP[0]: torch.randn(H, 2 * H, generator=g).bfloat16(), MTP[1]: torch.randn(H, generator=g).bfloat16()},
              str(src / "mtp.safetensors"))
    return src


def _load_dir(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _convert_there_and_back(rank, world_size, src, tmp):
    """In a process of its own (conversion makes a one-rank process group)."""
    from longstraw_mcore.checkpoint import convert, passthrough
    from longstraw_mcore.families import get_family

    family, logs, tmp = get_family("glm5_next"), [], Path(tmp)
    got = convert.hf_to_mcore_dir(family, src, tmp / "mc", log=logs.append)
    back = convert.mcore_to_hf_dir(family, tmp / "mc", tmp / "out", log=logs.append)

    def broken(directory, tensors, keep):  # a write that dies half-way: nothing may be left
        (Path(directory) / passthrough.FILE).write_bytes(b"half")
        raise OSError("disk full")

    passthrough.write, failed = broken, None
    try:
        convert.hf_to_mcore_dir(family, src, tmp / "failed", log=logs.append)
    except OSError as e:
        failed = str(e)
    left = sorted(p.name for p in tmp.iterdir())
    return got["kept"], got["skipped"], back, logs, sorted(p.name for p in (tmp / "mc").iterdir()), failed, left


def test_export_is_the_vlm_bit_for_bit(saved, tmp_path):
    from longstraw_mcore.checkpoint import passthrough
    from longstraw_mcore.families import get_family
    from longstraw_mcore.launch_local import run_ranks

    model, _, tensors, raw = saved
    src = _with_mtp(saved, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    kept, skipped, back, logs, files, failed, left = run_ranks(_convert_there_and_back, 1, str(src), str(work),
                                                               timeout_s=300)[0]
    vision = sorted(k for k in tensors if k.startswith("model.visual."))
    assert len(vision) == 25 and sorted(kept) == vision and sorted(skipped) == sorted(vision + MTP)
    assert passthrough.FILE in files and back == {"tensors": len(tensors), "kept": 25}, (files, back)
    assert any("kept 25 tensors" in line for line in logs) and any("skipped 2 tensors" in line for line in logs), logs
    assert failed == "disk full" and left == ["mc", "out"], left  # no `failed`, no half-written sibling
    out = work / "out"
    _same(_load_dir(out), tensors)  # decoder and vision tower bit for bit in their dtypes; no MTP
    assert json.loads((out / "config.json").read_text()) == raw
    source = passthrough.Source.of_checkpoint(work / "mc")  # what a run from --load mc copies into its steps
    assert source.config == raw and sorted(source.names()) == vision
    _same(dict(source.items()), {k: tensors[k] for k in vision})
    step = tmp_path / "step"
    step.mkdir()
    source.write_into(step)  # a hard link, so a step costs no second copy
    assert os.stat(step / passthrough.FILE).st_ino == os.stat(work / "mc" / passthrough.FILE).st_ino
    m, _ = G.read_config(src)
    from_hf = passthrough.Source.of_hf(get_family("glm5_next"), src, m)  # a run from --hf src
    assert from_hf.config == raw and from_hf.names() == sorted(from_hf.names()) == vision
    again = tmp_path / "again"
    again.mkdir()
    from_hf.write_into(again)
    assert (again / passthrough.FILE).read_bytes() == (work / "mc" / passthrough.FILE).read_bytes()

    hf = glm5_next_modeling(fla=False)
    loaded, info = hf.Glm5NextForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16,
                                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours, theirs = loaded.state_dict(), model.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, loaded(input_ids=ids).logits
    print(f"exported VLM: {len(tensors)} tensors ({len(vision)} vision) bit-exact; logits max diff "
          f"{float((a.float() - b.float()).abs().max()):.1e} over {tuple(a.shape)}")
    assert a.shape == (2, 11, V) and torch.equal(a, b)


def test_merge_writes_the_vlm(saved, tmp_path, monkeypatch):
    """adapters/merge.py on this family (the adapter handed in, not read from a PEFT directory): the merged weight is
    W + (alpha / r) B A, every other tensor but MTP copied bit for bit, config.json the base's."""
    from longstraw_mcore.adapters import merge
    from longstraw_mcore.config import AdapterConfig
    from longstraw_mcore.families import get_family

    _, _, tensors, raw = saved
    src = _with_mtp(saved, tmp_path)
    site = "model.language_model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(5)
    A, B = torch.randn(2, H, generator=g, dtype=torch.float64), torch.randn(D, 2, generator=g, dtype=torch.float64)
    cfg = AdapterConfig(rank=2, alpha=4.0)
    monkeypatch.setattr(merge, "read_peft", lambda *args, **kw: (cfg, {site: (A, B)}))
    assert merge.merge_into_hf(get_family("glm5_next"), src, tmp_path, tmp_path / "merged", log=print) == 1
    want = dict(tensors)
    w = tensors[site + ".weight"]
    want[site + ".weight"] = (w.double() + 2.0 * B @ A).to(w.dtype)
    assert not torch.equal(want[site + ".weight"], w)
    _same(_load_dir(tmp_path / "merged"), want)
    assert json.loads((tmp_path / "merged" / "config.json").read_text()) == raw
