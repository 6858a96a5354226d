"""`longstraw plan` (planner/memory.py): the analytic state formulas against hand-computed values, the
parameter count against the reference models, the Qwen3.6-27B 2M-token plan's consistency, and bad
input refused with the value named. (Planner vs measured memory is a benchmark table, not this test.)"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(path, *overrides):
    from longstraw_mcore.config import load_config

    return load_config(os.path.join(ROOT, path), list(overrides))


def test_state_formulas_by_hand():
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes
    from longstraw_mcore.families import get_family

    q = _cfg("configs/qwen3.6-27b.yaml").model
    attn = [t for t in q.layer_types if t == "full_attention"]
    assert len(attn) == 16
    # K and V: 4 KV heads x 256 dims x 2 (K, V) x 2 B x 16 layers = 64 KiB per position in bf16
    assert sum(analytic_state_bytes(get_family(q.family).layers, q, 1, 1, layer_types=attn).values()) == 4 * 256 * 2 * 2 * 16 == 64 * 1024
    g = _cfg("configs/glm-5.2.yaml").model
    # (512 + 64) x 2 B x 78 layers + 128 x 2 B x 21 full indexer layers = 95,232 B per position
    assert sum(analytic_state_bytes(get_family(g.family).layers, g, 1, 1).values()) == 576 * 2 * 78 + 128 * 2 * 21 == 95_232


def test_parameter_count_equals_the_reference_models():
    from hf_reference import build_hf_model, tiny_model_config

    from longstraw_mcore.planner.weights import rank_params
    from longstraw_mcore.families import get_family

    m = tiny_model_config()
    params = list(build_hf_model(m, seed=0).parameters())
    total = sum(p.numel() for p in params)
    vectors = sum(p.numel() for p in params if p.dim() == 1)
    assert m.padded_vocab_size(2) == m.vocab_size  # no padding to account for below
    assert rank_params(get_family(m.family), m, 1, 1, [m.num_layers], 0) == total
    # two stages hold everything once between them; TP=2 halves every matrix, vectors are replicated
    assert sum(rank_params(get_family(m.family), m, 1, 1, [3, m.num_layers - 3], s) for s in range(2)) == total
    assert rank_params(get_family(m.family), m, 2, 1, [m.num_layers], 0) == (total - vectors) // 2 + vectors


def test_qwen_27b_2m_tokens_plan_is_consistent():
    from longstraw_mcore.commands.plan import plan
    from longstraw_mcore.planner.memory import plan_memory
    from longstraw_mcore.families import get_family

    cfg = _cfg("configs/qwen3.6-27b.yaml", "parallel.tp=4", "parallel.cp=2", "replay.mode=detached")
    P = 2_097_152
    res = plan(cfg, P, 1024, 8, 8, "H20-96GB", 96.0, 0.05)
    per = res["per_rank_bytes"]
    # each rank keeps 1/cp of the positions and 1/tp of the 4 KV heads: 16 KiB per position, plus the
    # Gated DeltaNet layers' fixed-size recurrent state and conv window
    kv = 64 * 1024 // 4 * (P - 1) // 2
    assert kv <= per["prompt_state"] <= kv + 2**30, per["prompt_state"]
    assert res["device_bytes"] == 96 * 2**30
    assert res["fits"] == (res["total_per_rank_bytes"] <= res["device_bytes"])
    assert set(res) >= {"per_rank_bytes", "total_per_rank_bytes", "device_bytes", "fits", "max_prompt_len", "flops"}
    mx = res["max_prompt_len"]
    if mx:
        assert sum(plan_memory(get_family(cfg.model.family), cfg, mx, 1024, 8, 8, cuda=True).values()) <= res["device_bytes"]
    assert sum(plan_memory(get_family(cfg.model.family), cfg, mx + 1, 1024, 8, 8, cuda=True).values()) > res["device_bytes"]
    assert res["flops"]["capture"] > res["flops"]["replay"] > 0


def _plan_cli(*argv):
    from longstraw_mcore.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", *argv])
    return rc, out.getvalue(), err.getvalue().strip()


def test_plan_cli_json_and_bad_input():
    q27 = os.path.join(ROOT, "configs/qwen3.6-27b.yaml")
    rc, out, _ = _plan_cli("--config", q27, "--prompt-len", "65536", "--response-len", "512", "--group-size", "4",
                           "--gpus", "8", "--json", "parallel.tp=4", "parallel.cp=2")
    assert rc == 0 and json.loads(out)["inputs"]["layout"]["dp"] == 1
    rc, out, _ = _plan_cli("--config", os.path.join(ROOT, "configs/glm-5.2.yaml"), "--prompt-len", "2097152",
                           "--response-len", "1024", "--group-size", "8", "--gpus", "32", "parallel.cp=4")
    # GLM-5.x has its FLOP model too (planner/flops_mla.py, equal to the FLOP counter: tests/unit/test_flop_model.py)
    assert rc == 0 and "GiB per rank" in out and "| capture |" in out and "| replay |" in out
    for argv, want in [
        (("--gpus", "6"), "world size 6 is not divisible by tp*pp*cp = 4*1*1"),
        (("--gpus", "4", "--prompt-len", "0"), "prompt length 0: must be a positive integer"),
        (("--gpus", "4", "parallel.tp=3"), "is not divisible by parallel.tp=3"),
        (("--gpus", "4", "--device", "A100"), "--device 'A100': not a known device profile"),
    ]:
        base = {"--prompt-len": "4096", "--response-len": "256", "--group-size": "2"}
        args = list(argv)
        for k, v in base.items():
            if k not in args:
                args += [k, v]
        args = ["--config", q27] + [a for a in args if "=" not in a] + [a for a in args if "=" in a]
        rc, _, err = _plan_cli(*args)
        assert rc == 2 and want in err, (argv, err)


@pytest.mark.parametrize("name", ["H20-96GB", "H20-141GB", "H100-80GB", "H200-141GB"])
def test_device_profiles(name):
    from longstraw_mcore.planner.devices import device_profile

    d = device_profile(name)
    assert d.memory_bytes > 60 * 10**9 and d.bf16_flops > 1e14
    if name == "H20-141GB":  # the H20 with 141 GB of HBM3e (LongStraw's): the 96 GB card's compute
        assert (d.memory_bytes, d.bf16_flops) == (141 * 10**9, device_profile("H20-96GB").bf16_flops)


def test_validate_and_train_refuse_a_run_the_plan_does_not_fit(tmp_path, monkeypatch, capsys):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_rollouts import make_groups

    from longstraw_mcore.commands.preflight import check_fits
    from longstraw_mcore.config import ConfigError
    from longstraw_mcore.data.rollouts import write_rollouts

    roll = tmp_path / "r.jsonl"
    write_rollouts(roll, make_groups(512, 2, 64, 3, 8, seed=1))
    monkeypatch.setenv("LONGSTRAW_DEVICE_BYTES", str(2**20))  # a 1 MiB "device"
    tiny = os.path.join(ROOT, "configs/qwen3.6-tiny.yaml")
    rc, _, err = 0, "", ""
    from longstraw_mcore.cli import main

    err_buf = io.StringIO()
    with contextlib.redirect_stderr(err_buf):
        rc = main(["validate", "--config", tiny, "--hf", str(tmp_path), "--rollouts", str(roll), "--out",
                   str(tmp_path / "out"), "device=cpu"])
    err = err_buf.getvalue()
    assert rc == 2 and "the plan for this run needs" in err and "a rank has 0.00 GiB (LONGSTRAW_DEVICE_BYTES)" in err
    assert "--force" in err and not (tmp_path / "out").exists()
    cfg = _cfg("configs/qwen3.6-tiny.yaml", "device=cpu")
    from longstraw_mcore.data.rollouts import load_rollouts

    groups = load_rollouts(roll, cfg.model.vocab_size)
    with pytest.raises(ConfigError, match=r"P=64, R=8, G=3"):
        check_fits(cfg, groups, 1, False, "train")
    check_fits(cfg, groups, 1, True, "train")  # --force: a warning, then the run goes on
    assert "warning: the plan for this run needs" in capsys.readouterr().err
    monkeypatch.setenv("LONGSTRAW_DEVICE_BYTES", str(2**40))
    check_fits(cfg, groups, 1, False, "train")


def test_glm_5_2_config_file_holds_the_real_dimensions():
    import dataclasses

    from longstraw_mcore.config import glm_5_2

    published = sorted(os.listdir(os.path.join(ROOT, "configs/published")))
    assert len(published) == 5
    for path in ["configs/glm-5.2.yaml", "configs/glm-5.2-32xh20.yaml"] + [
            f"configs/published/{p}" for p in published if p.startswith("glm")]:
        assert dataclasses.asdict(_cfg(path).model) == dataclasses.asdict(glm_5_2()), path
    tiny = _cfg("configs/glm-5.2-tiny.yaml").model
    assert tiny.num_layers == 78 and tiny.indexer_types == glm_5_2().indexer_types
    assert tiny.mlp_types == glm_5_2().mlp_types
    q = _cfg("configs/qwen3.6-27b.yaml").model
    for path in ["configs/qwen3.6-27b-8xh20.yaml", "configs/qwen3.6-27b-16xh20-4m.yaml"] + [
            f"configs/published/{p}" for p in published if p.startswith("qwen")]:
        assert dataclasses.asdict(q) == dataclasses.asdict(_cfg(path).model), path


def test_4m_config_fits_16_h20_and_the_png_chart(tmp_path):
    """configs/qwen3.6-27b-16xh20-4m.yaml: 4,194,304 positions, detached, TP4 x CP4 on 16 H20-96GB fits
    (the state per rank equals the 2.1M point's on 8); `plan --png` draws it (a PNG file)."""
    rc, out, _ = _plan_cli("--config", os.path.join(ROOT, "configs/qwen3.6-27b-16xh20-4m.yaml"), "--prompt-len",
                           "4194304", "--response-len", "1024", "--group-size", "8", "--gpus", "16", "--json")
    res = json.loads(out)
    assert rc == 0 and res["fits"] and res["max_prompt_len"] >= 4_194_304
    eight = json.loads(_plan_cli("--config", os.path.join(ROOT, "configs/qwen3.6-27b-8xh20.yaml"), "--prompt-len",
                                 "2097152", "--response-len", "1024", "--group-size", "8", "--gpus", "8", "--json")[1])
    assert res["per_rank_bytes"]["prompt_state"] == eight["per_rank_bytes"]["prompt_state"]
    png = tmp_path / "plan.png"
    rc, out, _ = _plan_cli("--config", os.path.join(ROOT, "configs/qwen3.6-27b-16xh20-4m.yaml"), "--prompt-len",
                           "4194304", "--response-len", "1024", "--group-size", "8", "--gpus", "16", "--png", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not list(tmp_path.glob("*.tmp*"))
    rc, _, err = _plan_cli("--config", os.path.join(ROOT, "configs/qwen3.6-27b.yaml"), "--prompt-len", "4096",
                           "--response-len", "256", "--group-size", "2", "--gpus", "4", "--png", str(tmp_path / "x" / "p.png"))
    assert rc == 2 and "must name a .png file in an existing folder" in err


def test_plan_tree_counts_shared_segments_once():
    """`longstraw plan --tree`: the planner's pieces are the replay's (replay/tree.py on the same tree's
    responses), the replay FLOPs count every shared segment once (the flat group's are larger), the
    live path's segment states join the device memory, and bad input is refused naming the value."""
    import torch

    from longstraw_mcore.bench.trees import full_tree
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.flops import branch_flops
    from longstraw_mcore.planner.tree import tree_pieces
    from longstraw_mcore.replay import tree

    widths, lengths = (1, 2, 2, 4), (24, 24, 6, 10)
    responses = full_tree(512, widths, lengths, torch.Generator().manual_seed(0))
    assert sorted(tree_pieces(widths, lengths)) == sorted(tree.tree_pieces(tree.build_tree(responses), responses))
    q27 = os.path.join(ROOT, "configs/qwen3.6-27b.yaml")
    common = ["--config", q27, "--prompt-len", "65536", "--gpus", "8", "--json", "parallel.tp=4", "parallel.cp=2"]
    rc, out, _ = _plan_cli(*common[:-2], "--tree", "1,2,2,4:24,24,6,10", *common[-2:])
    assert rc == 0
    t = json.loads(out)
    rc, out, _ = _plan_cli(*common[:-2], "--response-len", "64", "--group-size", "16", *common[-2:])
    flat = json.loads(out)
    assert t["inputs"]["tree"]["replayed_tokens"] == 256 and t["inputs"]["tree"]["response_tokens"] == 1024
    assert (t["inputs"]["group_size"], t["inputs"]["response_len"]) == (16, 64)
    cfg = _cfg("configs/qwen3.6-27b.yaml", "parallel.tp=4", "parallel.cp=2")
    layers, P_cp = get_family(cfg.model.family).layers, -(-(65536 - 1) // 2) + 1
    ratio = branch_flops(layers, cfg.model, P_cp, tree_pieces(widths, lengths), False, 4) / \
        branch_flops(layers, cfg.model, P_cp, [64] * 16, False, 4)
    assert t["flops"]["replay"] == pytest.approx(flat["flops"]["replay"] * ratio, rel=1e-12) and ratio < 0.3
    assert t["flops"]["capture"] == flat["flops"]["capture"]
    extra = t["per_rank_bytes"].pop("tree_segments")
    assert 0 < extra < 2**30 and t["per_rank_bytes"] == flat["per_rank_bytes"]
    for argv, want in [(("--tree", "1,2:3"), "--tree '1,2:3': must be WIDTHS:LENGTHS"),
                       (("--tree", "2:0"), "--tree '2:0'"),
                       (("--tree", "2,2:3,3", "--group-size", "5"), "without another --group-size"),
                       (("--tree", "2,2:3,3", "--suggest"), "without --suggest"),
                       ((), "give --response-len and --group-size, or --tree")]:
        rc, _, err = _plan_cli("--config", q27, "--prompt-len", "4096", "--gpus", "8", *argv)
        assert rc == 2 and want in err, (argv, err)


def test_replay_terms_follow_the_token_budget():
    """The planner counts the executor's micro-steps (replay/plan.py `micro_steps`): a replay micro-step
    of G=8 branches of 128 tokens under replay.batch_tokens holds what one branch of its tokens holds
    (8 x 128 at 1,024, 4 x 128 at 512, 128 at 0); under pipeline parallelism its passes set the
    micro-batches in flight and the bubble; a prefix tree's passes are its segments and each node's
    tails in micro-steps, as tree_steps cuts them."""
    import torch

    from longstraw_mcore.bench.trees import full_tree
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.memory import phase_bytes
    from longstraw_mcore.planner.timing import bubble, in_flight, plan_time
    from longstraw_mcore.planner.tree import tree_passes
    from longstraw_mcore.replay import tree
    from longstraw_mcore.replay.plan import even_micro_steps

    fam, P = get_family("qwen3_5"), 65_536

    from longstraw_mcore.planner.devices import device_profile

    def replay(R, G, budget, *more):
        cfg = _cfg("configs/qwen3.6-27b.yaml", "parallel.tp=4", f"replay.batch_tokens={budget}", *more)
        return phase_bytes(fam, cfg, P, R, G, range(64), True)["replay"]

    for budget, per in ((1024, 8), (512, 4), (0, 1), (100, 1)):
        assert replay(128, 8, budget) == replay(128 * per, 1, 0), budget
    assert replay(128, 8, 1024) > replay(128, 8, 512) > replay(128, 8, 0)
    for budget, want in ((0, (8, 1)), (512, (2, 4)), (1000, (2, 7)), (8192, (1, 8))):
        assert even_micro_steps(128, 8, budget) == want
    # pp=4: 1F1B keeps min(pp - s, passes) micro-batches on stage s; the replay's bubble follows the passes
    for budget, passes in ((0, 8), (512, 2), (1024, 1)):
        cfg = _cfg("configs/qwen3.6-27b.yaml", "parallel.tp=4", "parallel.pp=4", f"replay.batch_tokens={budget}")
        assert in_flight(cfg, P, 128, 8, range(16)) == min(4, passes)
        t = plan_time(fam, cfg, P, 128, 8, 16, device_profile("H20-96GB"), 0.05, {})
        assert t["seconds"]["replay"] == pytest.approx(t["flops"]["replay"] / (148e12 * 0.05) * bubble(passes, 4))
    # a tree's passes: the replay's own steps on the same tree's responses (segments and tails' micro-steps)
    widths, lengths = (1, 2, 2, 4), (24, 24, 6, 10)
    responses = full_tree(512, widths, lengths, torch.Generator().manual_seed(0))
    root = tree.build_tree(responses)
    for budget in (0, 20, 40, 1000):
        steps = tree.tree_steps(root, [len(r) for r in responses], budget)
        assert tree_passes(widths, lengths, budget) == sum(s.phase in ("segment", "replay") for s in steps), budget
    assert [tree_passes(widths, lengths, b) for b in (0, 20, 40)] == [7 + 16, 7 + 8, 7 + 4]  # 7 segments


def test_glm_5_3_flash_config_file_holds_transformers_dimensions(tmp_path):
    """configs/glm5.3-flash.yaml == glm_5_3_flash(), whose architecture is transformers 5.23's Glm5NextConfig
    defaults (its docstring names zai-org/GLM-5.3-Flash) read through the checkpoint reader as a config.json; the tiny
    config keeps the layer pattern (every 4th layer MLA, 3 dense layers then MoE) and the 4 streams."""
    import dataclasses

    from longstraw_mcore.bench.hf_kernels import glm5_next_modeling
    from longstraw_mcore.checkpoint.glm5_next import read_config
    from longstraw_mcore.config import glm_5_3_flash

    hf = glm5_next_modeling(fla=False)
    cfg = hf.Glm5NextConfig()
    cfg.architectures = ["Glm5NextForConditionalGeneration"]
    cfg.save_pretrained(tmp_path)
    m, _ = read_config(tmp_path)
    assert m.architecture() == glm_5_3_flash().architecture()
    assert dataclasses.asdict(_cfg("configs/glm5.3-flash.yaml").model) == dataclasses.asdict(glm_5_3_flash())
    tiny, real = _cfg("configs/glm5.3-flash-tiny.yaml").model, glm_5_3_flash()
    n = tiny.num_layers
    assert tiny.mixer_types == real.mixer_types[:n] and tiny.mlp_layer_types == real.mlp_layer_types[:n]
    assert tiny.hc_mult == real.hc_mult == 4 and tiny.layer_types.count("mla_dsa_full") == n // 4
