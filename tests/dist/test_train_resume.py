"""`longstraw train` end to end on CPU (torchrun, 2 gloo ranks, data parallel 2, Megatron DDP +
distributed optimizer, exact mode): 8 steps with finite metrics; a run SIGKILLed right after its
step-4 checkpoint and resumed with --resume reproduces steps 5-8 exactly (every metric but wall
time and memory). Also: bad rollouts are refused with the group index and field before any model work."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _cmd(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "longstraw_mcore", "train", "--config", "configs/qwen3.6-tiny.yaml", *args,
            "replay.mode=exact", "replay.chunk_len=16", "train.lr=1e-3", "train.distributed_optimizer=true"]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def _kill_tree(pid: int) -> None:
    import psutil

    procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def _metrics(path):
    return [json.loads(line) for line in open(path)]


def test_train_8_steps_and_exact_resume(tmp_path):
    from make_rollouts import make_groups

    from longstraw_mcore.data.rollouts import write_rollouts

    rollouts = tmp_path / "r.jsonl"
    write_rollouts(rollouts, make_groups(512, 12, 40, 3, 8, seed=1, equal_reward_every=5))
    full = tmp_path / "full.jsonl"
    r = subprocess.run(_cmd("--rollouts", str(rollouts), "--steps", "8", "--metrics-out", str(full)),
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    a = _metrics(full)
    assert [m["step"] for m in a] == list(range(1, 9))
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in a)
    assert sum(m["skipped_groups"] for m in a) > 0
    # a step whose groups all had zero advantage makes no update; every other step does
    assert all(m["update_ok"] == (m["skipped_groups"] < m["groups"]) for m in a)

    ckpt, part = tmp_path / "ckpt", tmp_path / "part.jsonl"
    p = subprocess.Popen(_cmd("--rollouts", str(rollouts), "--steps", "8", "--save", str(ckpt),
                              "--metrics-out", str(part), "train.save_every=4"),
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         start_new_session=True)
    killed = False
    for line in p.stdout:
        if "checkpoint" in line and "step_000004" in line:
            _kill_tree(p.pid)  # torchrun's workers live in their own sessions: kill the whole tree
            killed = True
            break
    p.wait(timeout=120)
    assert killed
    before = _metrics(part)
    assert 4 <= len(before) < 8  # died after the checkpoint, before the end
    resumed = tmp_path / "resumed.jsonl"
    r = subprocess.run(_cmd("--rollouts", str(rollouts), "--steps", "8", "--save", str(ckpt), "--resume",
                            "--metrics-out", str(resumed), "train.save_every=4"),
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 4" in r.stdout and "resharding" not in r.stdout
    b = _metrics(resumed)
    assert [m["step"] for m in b] == list(range(5, 9))
    volatile = {"seconds", "peak_bytes"}
    for x, y in zip(a[4:], b):
        assert {k: v for k, v in x.items() if k not in volatile} == {k: v for k, v in y.items() if k not in volatile}
    print(f"steps 5-8 identical after kill + resume; step 8 loss {b[-1]['loss']:.6f}, grad norm "
          f"{b[-1]['grad_norm']:.6f}")


BAD = [
    ({"prompt": [1, 2], "responses": [[3]]}, "group 1: missing field 'rewards'"),
    ({"prompt": [1, 2], "responses": [[3], []], "rewards": [1, 0]}, "group 1: responses[1] is empty"),
    ({"prompt": [1, 2], "responses": [[3, 512]], "rewards": [1]}, "group 1: responses[0][1]=512: token id out of range [0, 512)"),
    ({"prompt": [1, -2], "responses": [[3]], "rewards": [1]}, "group 1: prompt[1]=-2: token id out of range"),
    ({"prompt": [1, 2], "responses": [[3], [4]], "rewards": [1, float("nan")]}, "group 1: rewards[1]=nan"),
    ({"prompt": [1, 2], "responses": [[3], [4]], "rewards": [1, 0], "old_logprobs": [[-1.0], [-1.0, -2.0]]},
     "group 1: old_logprobs[1]: length 2 != response length 1"),
    ({"prompt": [], "responses": [[3]], "rewards": [1]}, "group 1: prompt is empty"),
    ({"prompt": [1], "responses": [[3], [4]], "rewards": [1]}, "group 1: rewards count 1 != responses count 2"),
]


def test_bad_rollouts_refused_before_model_work(tmp_path):
    from longstraw_mcore.data.rollouts import RolloutError, load_rollouts

    good = {"prompt": [5], "responses": [[1, 2], [3]], "rewards": [0.0, 1.0]}
    for bad, needle in BAD:
        f = tmp_path / "bad.jsonl"
        f.write_text(json.dumps(good) + "\n" + json.dumps(bad).replace("NaN", "NaN") + "\n")
        try:
            load_rollouts(f, 512)
            raise AssertionError(f"accepted {bad}")
        except RolloutError as e:
            assert needle in str(e), (needle, str(e))
    # a one-token prompt is valid (its capture is empty)
    f = tmp_path / "one.jsonl"
    f.write_text(json.dumps(good) + "\n")
    assert load_rollouts(f, 512)[0].prompt == [5]
    # the command line reports it with exit code 2, before any process group or model is built
    f.write_text(json.dumps(good) + "\n" + json.dumps(BAD[0][0]) + "\n")
    r = subprocess.run([sys.executable, "-m", "longstraw_mcore", "train", "--config", "configs/qwen3.6-tiny.yaml",
                        "--rollouts", str(f), "--steps", "1"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "group 1: missing field 'rewards'" in r.stderr, r.stderr[-2000:]
    assert "megatron" not in r.stderr.lower()
