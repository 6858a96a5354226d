"""Your own task through `train --online --dataset`, as a user runs it (2 gloo ranks, the launcher):

- key recall written as a text dataset (examples/key_recall: one word per token id, the on-the-fly word
  tokenizer, a reward function in a file) trains exactly as the built-in task on the same seeds: its
  rows are the built-in prompts in the built-in order, so the token ids, the sampled tokens, the
  rewards, and therefore every loss, gradient norm and held-out reward are equal, step for step;
- the coding example (a generated code base, a reward that runs the code in a subprocess) runs end to
  end beside rewards that raise, hang past reward.timeout_s and return NaN: the run goes on, the
  failures counted per kind in the metrics (and in the TensorBoard event files);
- a run stopped mid-epoch (shuffled rows) and resumed continues with the next rows: its metrics equal
  the uninterrupted run's, bit for bit;
- bad input is refused before any model work with exit status 2 and one line.

Not covered here: layouts (tests/dist/test_env_layouts.py), the Python API (tests/dist/test_api.py)."""

from __future__ import annotations

import json
import os

import pytest

from launch import ROOT, longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

SMALL = ["train.groups_per_step=2", "rollout.group_size=8", "task.min_len=24", "task.max_len=40",
         "task.start_len=[24,28]", "task.hold_steps=1", "task.ramp_steps=2", "task.eval_prompts=4",
         "task.eval_every=2", "replay.chunk_len=16"]


def _script(example: str):
    """examples/EXAMPLE/make_dataset.py as a module (each example has one of that name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"make_{example}", os.path.join(ROOT, "examples", example,
                                                                                  "make_dataset.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _metrics(path):
    return [json.loads(x) for x in open(path) if x.strip()]


@pytest.fixture(scope="module")
def key_recall(tmp_path_factory):
    out = tmp_path_factory.mktemp("kr")
    _script("key_recall").main(["--config", "configs/demo-key-recall.yaml", "--dp", "2", "--steps", "4", "--out",
                       str(out / "data"), *SMALL])
    return out


def _kr_args(d):
    return ("--dataset", str(d / "train.jsonl"), "--eval-dataset", str(d / "heldout.jsonl"), "--tokenizer",
            str(d / "tokenizer"), "--reward", "examples/key_recall/reward.py:reward")


PPO = ("grpo.objective=ppo", "--critic", "policy")


@pytest.mark.parametrize("objective", ["grpo", "ppo"])
def test_key_recall_text_equals_builtin(key_recall, objective):
    """(PPO: the critic starts from the policy's weights; its value loss and gradient norm equal too.)"""
    runs = {}
    ppo = PPO if objective == "ppo" else ()
    steps = "4" if objective == "grpo" else "2"
    for name, extra, over in (("builtin", ppo, ()), ("text", (*_kr_args(key_recall / "data"), *ppo),
                                                      ("dataset.shuffle=false",))):
        m = key_recall / f"{name}_{objective}.jsonl"
        r = longstraw(2, "train", "--config", "configs/demo-key-recall.yaml", "--online", "--steps", steps,
                      "--metrics-out", str(m), *extra, *SMALL, *over, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[name] = _metrics(m)
    a, b = runs["builtin"], runs["text"]
    assert [x["step"] for x in a] == [x["step"] for x in b] == list(range(int(steps) + 1))
    for x, y in zip(a, b):
        print(f"step {x['step']}: loss {x.get('loss')} / {y.get('loss')}, grad norm {x.get('grad_norm')} / "
              f"{y.get('grad_norm')}, reward {x.get('reward_mean')} / {y.get('reward/reward')}, held-out "
              f"{x.get('heldout_reward')} / {y.get('heldout_reward')}")
        for k in ("loss", "grad_norm", "reward_mean", "heldout_reward", "tokens", "prompt_tokens", "value_loss",
                  "critic_grad_norm"):
            assert x.get(k) == y.get(k), (x["step"], k, x.get(k), y.get(k))
        assert objective == "grpo" or x["step"] == 0 or x["critic_update_ok"]
    assert any(x.get("grad_norm") for x in a[1:]), "no step had an advantage: the comparison would be empty"
    assert all(y["reward/reward"] == y["reward_mean"] for y in b[1:])


def test_resume_mid_epoch_bit_exact(key_recall):
    """6 rows, 4 drawn per step (2 ranks x 2): step 2 ends mid-epoch 1, in a shuffled order."""
    d = key_recall / "data"
    six = key_recall / "six.jsonl"
    six.write_text("".join(open(d / "train.jsonl").readlines()[:6]))
    common = ("train", "--config", "configs/demo-key-recall.yaml", "--online", "--dataset", str(six), "--tokenizer",
              str(d / "tokenizer"), "--reward", "examples/key_recall/reward.py:reward")
    over = (*SMALL, "task.eval_prompts=0", "train.save_every=2", "dataset.seed=3")
    whole, part = key_recall / "whole", key_recall / "part"
    r = longstraw(2, *common, "--steps", "4", "--save", str(whole), "--metrics-out", str(whole / "m.jsonl"), *over)
    assert r.returncode == 0, r.stderr[-3000:]
    r = longstraw(2, *common, "--steps", "2", "--save", str(part), "--metrics-out", str(part / "m.jsonl"), *over)
    assert r.returncode == 0, r.stderr[-3000:]
    r = longstraw(2, *common, "--steps", "4", "--save", str(part), "--resume", "--metrics-out", str(part / "m.jsonl"),
                  *over)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    a, b = _metrics(whole / "m.jsonl"), _metrics(part / "m.jsonl")
    assert [x["step"] for x in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for k in ("loss", "grad_norm", "reward_mean", "prompt_tokens", "tokens"):
            assert x[k] == y[k], (x["step"], k, x[k], y[k])
    meta = json.loads((part / "step_000004" / "longstraw_model.json").read_text())
    assert meta["dataset"]["position"] == 16 and meta["dataset"]["rows"] == 6
    # a different file is refused at resume, naming it
    other = key_recall / "other.jsonl"
    other.write_text("".join(open(d / "train.jsonl").readlines()[6:12]))
    r = longstraw(2, *[x if x != str(six) else str(other) for x in common], "--steps", "5", "--save", str(part),
                  "--resume", *over)
    assert r.returncode == 2 and "is not the file the checkpoint was trained on" in r.stderr, r.stderr[-2000:]


def test_coding_example_with_failing_rewards(tmp_path):
    _script("coding").main(["--out", str(tmp_path / "data"), "--train", "32", "--heldout", "4", "--min-modules", "1",
                       "--max-modules", "3"])
    d, m = tmp_path / "data", tmp_path / "m.jsonl"
    r = longstraw(2, "train", "--config", "configs/demo-coding.yaml", "--online", "--steps", "2",
                  "--dataset", str(d / "train.jsonl"), "--eval-dataset", str(d / "heldout.jsonl"),
                  "--tokenizer", str(d / "tokenizer"), "--reward", "examples/coding/reward.py:reward",
                  "--reward", "tests.own_task.flaky_rewards:raises", "--reward", "tests.own_task.flaky_rewards:hangs",
                  "--reward", "tests.own_task.flaky_rewards:nan", "--metrics-out", str(m),
                  "--tensorboard", str(tmp_path / "tb"), "reward.weights=[1,1,1,1]", "reward.timeout_s=3", "train.groups_per_step=2",
                  "rollout.group_size=4", "task.eval_prompts=4", "task.eval_every=2", "task.log_samples=1",
                  timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = _metrics(m)
    steps = [x for x in rows if "loss" in x]
    assert len(steps) == 2 and "heldout_reward" in rows[0] and "heldout_reward" in rows[-1]
    for x in steps:   # 2 groups per rank x 2 ranks: each failing reward fails on every group
        assert x["reward_failures/exception"] == 4 and x["reward_failures/timeout"] == 4, x
        assert x["reward_failures/nonfinite"] == 4, x
        assert x["reward/raises"] == x["reward/hangs"] == x["reward/nan"] == 0.0
        assert 0.0 <= x["reward/reward"] <= 1.0 and x["reward_mean"] == x["reward/reward"]
    out = r.stdout + r.stderr
    for kind in ("exception", "timeout", "nonfinite"):   # logged once per kind, naming the row
        assert sum(kind in line and "row" in line for line in out.splitlines()) >= 1, kind
    assert "[sample]" in r.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("reward_failures/timeout")] == [4.0, 4.0]
    assert [e.step for e in events.Scalars("heldout_reward")] == [0, 2]


BAD = [
    ("row without a prompt", {"rows": [{"question": "x"}]}, [], 'needs "prompt" (text) or "messages"'),
    ("chat row, no chat template", {"rows": [{"messages": [{"role": "user", "content": "d1 d2"}]}]}, [],
     "no chat template"),
    ("unimportable reward", {}, ["--reward", "no_such_module_42:f"], "cannot import"),
    ("wrong number of values", {}, ["--reward", "tests.own_task.flaky_rewards:wrong_count"], "returned 1 value"),
    ("prompt over the limit", {}, ["dataset.max_prompt_tokens=4"], "exceeds the limit of 4"),
    ("unimportable environment", {}, ["--env", "tests.own_task.no_such_env:Env"], "cannot import"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_exit_2_one_line(key_recall, tmp_path, capsys, case):
    from longstraw_mcore.cli import main

    _, spec, extra, expect = case
    d = key_recall / "data"
    data = tmp_path / "rows.jsonl"
    rows = spec.get("rows") or [{"prompt": "d1 d2 d3 d4 d5 M", "key": "v1"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = [] if "--reward" in extra else ["--reward", "examples/key_recall/reward.py:reward"]
    code = main(["train", "--config", "configs/demo-key-recall.yaml", "--online", "--steps", "1", "--dataset",
                 str(data), "--tokenizer", str(d / "tokenizer"), *reward, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expect in err[0], err
    import torch.distributed as dist

    assert not dist.is_initialized()   # refused before any process group


def test_overrides_anywhere_among_the_options():
    """key=value overrides may sit between options (argparse alone refuses a second run of them)."""
    from longstraw_mcore.cli import build_parser, parse

    args = parse(build_parser(), ["train", "--online", "a.b=1", "--reward", "m:f", "--steps", "3", "c.d=2"])
    assert args.overrides == ["a.b=1", "c.d=2"] and args.reward == ["m:f"] and args.steps == 3
    with pytest.raises(SystemExit):
        parse(build_parser(), ["train", "--online", "--steps", "3", "--no-such-flag"])
