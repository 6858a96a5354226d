"""Sampling from the captured prompt state (rollout/sampler.py) against plain references, float64:
  - temperature 0: the tokens equal greedy decoding by full-sequence forward passes of the same model
    (prompt + tokens so far, no state), for the tiny Qwen hybrid and the tiny GLM-5.2;
  - every sampled token's recorded log-prob equals the model's log-prob of it, as branch-replay
    scoring (replay/engine.score_group) computes it: <= 1e-10 (temperature 0.8, top-p 0.9);
  - top-p -> 0 is greedy; a stop id ends a branch (kept as its last token); the same seed gives the
    same tokens and another seed others;
  - TP=2, CP=2 and PP=2 sample the same tokens as TP=1 for the same seed, with the same log-probs
    (2 gloo ranks; at PP=2 the last stage picks and broadcasts), and `train --online` runs at PP=2;
  - tree sampling (`rollout.branch_at` / `branch_k`, rollout/tree_sampler.py): at temperature 0 every
    response equals greedy full-sequence decoding; sampled, the responses share exactly their tokens
    before each split (group_size x branch_k ** len(branch_at) of them) and their recorded log-probs
    equal scoring's (which replays them as a prefix tree); TP=2, CP=2 and PP=2 sample the same tree;
  - tool lookup (tasks/tool_lookup.py): [call, the tool's token, answer] with loss mask [1, 0, 1],
    the tool's token the task's answer to the call, the sampled turns' log-probs equal scoring's;
  - the task's reward, chance and length curriculum, and bad sampling or task input refused naming
    the value."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from longstraw_mcore.launch_local import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(config, overrides):
    import torch

    from longstraw_mcore.config import load_config
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel

    cfg = load_config(os.path.join(ROOT, "configs", config), ["model.dtype=float64", "device=cpu", *overrides])
    torch.manual_seed(11)
    return cfg, get_family(cfg.model.family).build_model(cfg.model, setup_parallel(cfg), "cpu")


def _greedy_reference(model, prompt, n):
    """Greedy decoding by full-sequence forward passes (no prompt state)."""
    import torch

    from longstraw_mcore.rollout.sampler import full_logits

    seq = list(prompt)
    for _ in range(n):
        hidden = model(torch.tensor([seq]), hidden_only=True)
        seq.append(int(torch.argmax(full_logits(model, hidden[-1]), dim=-1)[0]))
    return seq[len(prompt):]


def _single_worker(rank, world_size):
    import torch

    from longstraw_mcore.replay.engine import score_group
    from longstraw_mcore.rollout.sampler import sample_group

    out = {}
    for config, extra in (("qwen3.6-tiny.yaml", []), ("glm-5.2-tiny.yaml", ["model.num_layers=4"])):
        cfg, model = _model(config, extra + ["replay.chunk_len=16"])
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, cfg.model.vocab_size, (29,), generator=g).tolist()
        greedy = dataclasses.replace(cfg.rollout, temperature=0.0, group_size=2, max_tokens=4)
        got = sample_group(model, prompt, greedy, cfg.replay, index=0)
        out[(config, "greedy")] = (got.responses, _greedy_reference(model, prompt, 4))
        hot = dataclasses.replace(cfg.rollout, temperature=0.8, top_p=0.9, group_size=4, max_tokens=4, seed=5)
        s = sample_group(model, prompt, hot, cfg.replay, index=2)
        budgets = (cfg.replay.batch_tokens, 0, 12)  # all 4 in one micro-step, one each, 3 + 1
        out[(config, "logprobs")] = max(
            abs(a - float(b)) for budget in budgets
            for lp, ref in zip(s.logprobs, score_group(model, prompt, s.responses,
                                                       dataclasses.replace(cfg.replay, batch_tokens=budget))[0])
            for a, b in zip(lp, ref))
        out[(config, "hot")] = s.responses
        # a tree: 2 trunks, each splitting in 2 at depths 2 and 4 (8 responses of 6 tokens)
        tree = dict(group_size=2, max_tokens=6, branch_at=[2, 4], branch_k=2)
        out[(config, "tree_greedy")] = (sample_group(model, prompt, dataclasses.replace(greedy, **tree), cfg.replay,
                                                     index=0).responses, _greedy_reference(model, prompt, 6))
        t = sample_group(model, prompt, dataclasses.replace(hot, **tree), cfg.replay, index=2)
        scored, _ = score_group(model, prompt, t.responses, cfg.replay)
        out[(config, "tree")] = (t.responses, max(abs(a - float(b)) for lp, ref in zip(t.logprobs, scored)
                                                  for a, b in zip(lp, ref)))
        if config.startswith("qwen"):
            # tool lookup's two turns around the tool's token (tasks/tool_lookup.py), against one capture
            import random

            from longstraw_mcore.tasks.tool_lookup import ToolLookup

            task = ToolLookup(dataclasses.replace(cfg.task, name="tool_lookup", n_values=8, min_len=20, max_len=30),
                              cfg.model.vocab_size)
            tp_prompt, secret = task.make(random.Random(0))
            calling = dataclasses.replace(hot, group_size=6)
            grp, _ = task.rollout(model, tp_prompt, secret, calling, cfg.replay, 3)
            sc, _ = score_group(model, tp_prompt, grp.responses, cfg.replay)
            out["tool"] = (grp, secret,
                           max(abs(lp[i] - float(ref[i])) for lp, ref in zip(grp.old_logprobs, sc) for i in (0, 2)))
            out["same_seed"] = sample_group(model, prompt, hot, cfg.replay, index=2).responses
            out["other_seed"] = sample_group(model, prompt, dataclasses.replace(hot, seed=6), cfg.replay, 2).responses
            tiny_p = dataclasses.replace(hot, top_p=1e-9)
            out["top_p_greedy"] = (sample_group(model, prompt, tiny_p, cfg.replay, 2).responses,
                                   sample_group(model, prompt, dataclasses.replace(greedy, group_size=4,
                                                                                   max_tokens=4), cfg.replay).responses)
            stop = s.responses[0][1]
            stopped = sample_group(model, prompt, dataclasses.replace(hot, stop_ids=[stop]), cfg.replay, 2)
            out["stop"] = (stop, stopped.responses, stopped.logprobs)
    return out


def test_sampling_equals_greedy_reference_and_scoring():
    out = run_ranks(_single_worker, 1, timeout_s=600)[0]
    for config in ("qwen3.6-tiny.yaml", "glm-5.2-tiny.yaml"):
        got, ref = out[(config, "greedy")]
        print(f"{config}: greedy {got[0]} vs full-sequence {ref}; sampled log-probs vs scoring "
              f"{out[(config, 'logprobs')]:.1e}")
        assert got == [ref, ref]
        assert out[(config, "logprobs")] <= 1e-10
        assert len(set(map(tuple, out[(config, "hot")]))) > 1  # sampling, not argmax
        tree_got, tree_ref = out[(config, "tree_greedy")]
        assert tree_got == [tree_ref] * 8, (tree_got, tree_ref)
        responses, worst = out[(config, "tree")]
        print(f"{config}: tree {responses}; log-probs vs scoring {worst:.1e}")
        assert worst <= 1e-10 and len(responses) == 8 and all(len(r) == 6 for r in responses)
        for i, r in enumerate(responses):  # leaf i: trunk i // 4, first split child (i // 2) % 2
            for j, q in enumerate(responses):
                same = 6 if i == j else 4 if i // 2 == j // 2 else 2 if i // 4 == j // 4 else 0
                assert r[:same] == q[:same]
        assert len({tuple(r[:2]) for r in responses}) == 2 and len({tuple(r[:4]) for r in responses}) == 4
        assert len({tuple(r[:5]) for r in responses}) > 4  # siblings diverge after a split (sampled)
    grp, secret, worst = out["tool"]
    assert worst <= 1e-10 and grp.loss_masks == [[1, 0, 1]] * 6
    for r, rew in zip(grp.responses, grp.rewards):
        assert len(r) == 3 and r[1] == secret and rew == float(r[2] == secret)
    assert out["same_seed"] == out[("qwen3.6-tiny.yaml", "hot")]
    assert out["other_seed"] != out["same_seed"]
    assert out["top_p_greedy"][0] == out["top_p_greedy"][1]
    stop, responses, logprobs = out["stop"]
    assert responses[0] == out[("qwen3.6-tiny.yaml", "hot")][0][:2]  # same stream up to the stop token
    for r, lp in zip(responses, logprobs):
        assert len(r) == len(lp) and (stop not in r or r.index(stop) == len(r) - 1)


def _layout_worker(rank, world_size, tmp):
    import torch

    from longstraw_mcore.rollout.sampler import sample_group

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full

    from longstraw_mcore.ops import dispatch

    out, full = {}, None
    # "cp2 fused": the fused CPU attention op (ops.attention=flash), whose folded-batch partials once reached
    # the context-parallel merge's collectives as transposed views and drew other tokens
    for name, layout in (("tp1", []), ("tp2", ["parallel.tp=2"]), ("cp2", ["parallel.cp=2"]), ("pp2", ["parallel.pp=2"]),
                         ("cp2 fused", ["parallel.cp=2", "ops.attention=flash"])):
        cfg, model = _model("qwen3.6-tiny.yaml", layout + ["replay.chunk_len=16"])
        dispatch.configure(cfg.ops)
        if full is None:
            full = gather_full(model)  # every layout gets TP1's weights (PP stages would initialize their own)
        else:
            load_full(model, full)
        g = torch.Generator().manual_seed(4)
        prompt = torch.randint(0, cfg.model.vocab_size, (45,), generator=g).tolist()
        hot = dataclasses.replace(cfg.rollout, temperature=1.0, top_p=0.95, group_size=4, max_tokens=6, seed=9)
        s = sample_group(model, prompt, hot, cfg.replay, index=1)
        out[name] = (s.responses, s.logprobs)
        t = sample_group(model, prompt, dataclasses.replace(hot, group_size=1, branch_at=[2, 4], branch_k=2),
                         cfg.replay, index=1)
        out[name + " tree"] = (t.responses, t.logprobs)
    dispatch.configure(cfg.ops.__class__())
    # on-policy training at PP=2: the stages sample together, held-out reward is reduced over data parallel
    from longstraw_mcore.cli import main

    metrics = os.path.join(tmp, "pp_online.jsonl")
    out["pp_online"] = main(["train", "--config", os.path.join(ROOT, "configs", "demo-key-recall.yaml"), "--online",
                             "--steps", "2", "--metrics-out", metrics, "parallel.pp=2", "train.groups_per_step=2",
                             "rollout.group_size=4", "task.eval_every=2", "task.eval_prompts=3"])
    return out


def test_tp2_cp2_and_pp2_sample_the_same_tokens_as_tp1(tmp_path):
    import json

    outs = run_ranks(_layout_worker, 2, str(tmp_path), timeout_s=600)
    ref_tokens, ref_lp = outs[0]["tp1"]
    assert len(set(map(tuple, ref_tokens))) > 1  # sampled, not one repeated answer
    assert [out.pop("pp_online") for out in outs] == [0, 0]
    online = [json.loads(x) for x in open(tmp_path / "pp_online.jsonl")]
    assert [m["step"] for m in online] == [0, 1, 2] and 0.0 <= online[2]["heldout_reward"] <= 1.0
    assert all(m["groups"] == 2 and 24 * 2 <= m["prompt_tokens"] <= 32 * 2 for m in online[1:])  # curriculum start
    for rank, out in enumerate(outs):
        assert set(out) == {x + t for x in ("tp1", "tp2", "cp2", "pp2", "cp2 fused") for t in ("", " tree")}
        for name, (tokens, lp) in out.items():
            ref_tokens, ref_lp = outs[0]["tp1 tree" if name.endswith("tree") else "tp1"]
            assert tokens == ref_tokens, (rank, name)
            worst = max(abs(a - b) for x, y in zip(lp, ref_lp) for a, b in zip(x, y))
            assert worst <= 1e-10, (rank, name, worst)


def test_key_recall_task_and_bad_sampling_input():
    import random

    from longstraw_mcore.config import ConfigError, RolloutConfig, TaskConfig, load_config
    from longstraw_mcore.rollout.sampler import check_prompt
    from longstraw_mcore.tasks.key_recall import KeyRecall, reward

    t = KeyRecall(TaskConfig(min_len=20, max_len=40, key_len=3, n_values=16), vocab_size=512)
    prompt, key = t.make(random.Random(0))
    assert 20 <= len(prompt) <= 40 and prompt[-1] == t.marker and prompt.count(t.marker) == 1
    at = next(i for i, x in enumerate(prompt) if x in t.values)
    assert prompt[at:at + 3] == key and all(v in t.values for v in key)
    assert all(x >= t.first_distractor for i, x in enumerate(prompt) if not at <= i < at + 3 and i < len(prompt) - 1)
    assert reward(key, key) == 1.0 and reward(key[:1] + [0, 0], key) == pytest.approx(1 / 3)
    assert reward([], key) == 0.0 and t.chance == 1 / 16
    # a prompt-ignoring policy's best expected reward is chance: every value is equally likely per position
    rng = random.Random(1)
    keys = [t.make(rng)[1] for _ in range(4000)]
    best_fixed = max(sum(reward([v] * 3, k) for k in keys) / len(keys) for v in t.values)
    assert abs(best_fixed - t.chance) < 0.02
    # the length curriculum: held, then grown geometrically to [min_len, max_len]; examples follow it
    c = TaskConfig(min_len=256, max_len=1024, start_len=[16, 64], hold_steps=10, ramp_steps=20)
    assert [c.lengths(s) for s in (1, 10, 20, 30, 31, 500)] == [(16, 64), (16, 64), (64, 256), (256, 1024),
                                                                 (256, 1024), (256, 1024)]
    assert TaskConfig(min_len=256, max_len=1024).lengths(1) == (256, 1024)
    rng = random.Random(2)
    short = [len(KeyRecall(c, 512).make(rng, c.lengths(1))[0]) for _ in range(200)]
    full = [len(KeyRecall(c, 512).make(rng)[0]) for _ in range(200)]
    assert 16 <= min(short) and max(short) <= 64 and 256 <= min(full) and max(full) <= 1024
    for kwargs, want in [(dict(start_len=[16]), r"task.start_len=\[16\]: must be \[min, max\]"),
                         (dict(start_len=[16, 2000]), "max <= task.max_len=256"),
                         (dict(hold_steps=5), "task.hold_steps=5, task.ramp_steps=0 without task.start_len"),
                         (dict(min_len=300), "task.min_len=300, task.max_len=256: need 10 <= min_len <= max_len"),
                         (dict(key_len=0), "task.key_len=0: must be an integer in 1..16"),
                         (dict(n_values=1), "task.n_values=1: must be an integer >= 2")]:
        with pytest.raises(ConfigError, match=want):
            TaskConfig(**kwargs)
    with pytest.raises(ConfigError, match="model.vocab_size=20 is too small for key recall with task.n_values=16"):
        KeyRecall(TaskConfig(), vocab_size=20)
    from longstraw_mcore.tasks.tool_lookup import ToolLookup, reward as tool_reward

    tl = ToolLookup(TaskConfig(name="tool_lookup", min_len=20, max_len=30, n_values=8), vocab_size=32)
    p, secret = tl.make(random.Random(0))
    assert 20 <= len(p) <= 30 and p[-1] == tl.marker and all(x >= tl.first_distractor for x in p[:-1])
    assert secret in tl.values and tl.tool(7, secret) == secret
    assert tool_reward([7, secret, secret], secret) == 1.0 and tool_reward([7, secret, tl.marker], secret) == 0
    assert tl.chance == 1 / 8
    with pytest.raises(ConfigError, match="model.vocab_size=20 is too small for tool lookup with task.n_values=16"):
        ToolLookup(TaskConfig(name="tool_lookup"), vocab_size=20)
    for overrides, want in [(["rollout.temperature=-0.5"], "rollout.temperature=-0.5: must be >= 0"),
                            (["rollout.top_p=0"], "rollout.top_p=0"), (["rollout.top_p=1.5"], "rollout.top_p=1.5"),
                            (["rollout.max_tokens=0"], "rollout.max_tokens=0: must be an integer >= 1"),
                            (["rollout.stop_ids=[600]"], "rollout.stop_ids=[600]: [600] not below model.vocab_size=512"),
                            (["rollout.branch_at=[4,2]"], "rollout.branch_at=[4, 2]: must be strictly increasing"),
                            (["rollout.branch_at=[0]"], "rollout.branch_at=[0]: must be strictly increasing token "
                                                        "depths in [1, rollout.max_tokens=32)"),
                            (["rollout.branch_at=[32]"], "rollout.branch_at=[32]"),
                            (["rollout.branch_k=1"], "rollout.branch_k=1: must be an integer >= 2")]:
        with pytest.raises(ConfigError, match=re.escape(want)):
            load_config(os.path.join(ROOT, "configs", "qwen3.6-tiny.yaml"), overrides)
    with pytest.raises(ConfigError, match="prompt 3: prompt of 9 tokens; rollout needs 2 to rollout.max_prompt_len=8"):
        check_prompt([5] * 9, RolloutConfig(max_prompt_len=8), 512, "prompt 3")


def test_rollout_cli_refuses_bad_input_before_any_model_work(tmp_path, capsys):
    from longstraw_mcore.cli import main

    cfg = os.path.join(ROOT, "configs", "qwen3.6-tiny.yaml")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}\n')
    cases = [
        (["--task-prompts", "4", "rollout.temperature=-1"], "rollout.temperature=-1.0: must be >= 0"),
        (["--task-prompts", "4", "rollout.top_p=0"], "rollout.top_p=0.0: must be in (0, 1]"),
        (["--task-prompts", "4", "rollout.max_tokens=0"], "rollout.max_tokens=0: must be an integer >= 1"),
        (["--prompts", str(prompts), "rollout.max_prompt_len=8"],
         "line 1: prompt of 10 tokens; rollout needs 2 to rollout.max_prompt_len=8"),
    ]
    for argv, want in cases:
        out = tmp_path / "r.jsonl"
        rc = main(["rollout", "--config", cfg, "--out", str(out), *argv, "device=cpu"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and want in err and len(err.splitlines()) == 1, (argv, err)
        assert not out.exists()


def _cli_worker(rank, world_size, tmp):
    from longstraw_mcore.cli import main
    from longstraw_mcore.data.rollouts import load_rollouts

    cfg = os.path.join(ROOT, "configs", "qwen3.6-tiny.yaml")
    out = os.path.join(tmp, "r.jsonl")
    common = ["device=cpu", "rollout.group_size=4", "rollout.max_tokens=2", "task.min_len=24", "task.max_len=40"]
    rc = main(["rollout", "--config", cfg, "--task-prompts", "3", "--out", out, *common])
    groups = load_rollouts(out, 512)
    rc2 = main(["train", "--config", cfg, "--rollouts", out, "--steps", "1", "--metrics-out",
                os.path.join(tmp, "m.jsonl"), *common])
    rc3 = main(["train", "--config", cfg, "--online", "--steps", "2", "--metrics-out", os.path.join(tmp, "online.jsonl"),
                *common, "task.eval_every=2", "task.eval_prompts=2", "replay.batch_tokens=4"])  # micro-steps of <= 4 tokens
    return rc, [(len(g.prompt), g.responses, g.rewards, g.old_logprobs) for g in groups], rc2, rc3


def test_rollout_file_feeds_train_and_train_online_runs(tmp_path):
    """`longstraw rollout --task-prompts` writes a rollouts file `train` reads (with old_logprobs);
    `train --online` samples, trains and logs held-out reward."""
    import json

    rc, groups, rc2, rc3 = run_ranks(_cli_worker, 1, str(tmp_path), timeout_s=600)[0]
    assert rc == 0 and rc2 == 0 and rc3 == 0 and len(groups) == 3
    for P, responses, rewards, old in groups:
        assert 24 <= P <= 40 and len(responses) == 4 and all(len(r) == 2 for r in responses)
        assert all(0.0 <= x <= 1.0 for x in rewards) and all(len(o) == 2 and max(o) < 0 for o in old)
    online = [json.loads(x) for x in open(tmp_path / "online.jsonl")]
    assert [m["step"] for m in online] == [0, 1, 2] and "heldout_reward" in online[0] and "heldout_reward" in online[2]
    assert all("sample_seconds" in m for m in online[1:])
