"""The examples/ folder against the built-in tasks it writes as text.

Key recall and tool lookup: the datasets' rows, encoded by their tokenizer (AutoTokenizer), are the token
ids `train --online` draws, in the order it draws them: OnlineGroups.groups is run with a recording
task in place of sampling (no model), at dp=2, through a length curriculum and with replay.reuse_steps=2;
held-out rows are OnlineGroups' held-out prompts. The text rewards equal the built-in id rewards on the
same responses (random id sequences, decoded). Coding: the reward runs the generated code and agrees
with row["answer"], and with a changed answer in the code (so it is not reading row["answer"]); the
answer's digit is the prompt's one digit 1..9 and one token. Not covered: the dataset path itself
(tokenizing rows, decoding responses, the environment loop): the trainer's tests own those.
"""

import importlib.util
import json
import random
from pathlib import Path

import pytest

from longstraw_mcore.config import load_config
from longstraw_mcore.rollout.online import OnlineGroups
from longstraw_mcore.tasks import key_recall, tool_lookup

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# lengths grow over steps 2..4 and one block of prompts serves two steps: the order's hard cases
ORDER = ["train.groups_per_step=3", "task.hold_steps=1", "task.ramp_steps=3", "replay.reuse_steps=2",
         "adapter.rank=4", "adapter.prompt=frozen"]


def load(rel: str):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_")[:-3], EXAMPLES / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Recorder:
    """Stands in for the task inside OnlineGroups.groups: draws prompts as the task does, records them
    instead of sampling."""

    def __init__(self, task):
        self.task, self.seen = task, []

    def make(self, rng, lengths=None):
        return self.task.make(rng, lengths)

    def rollout(self, model, prompt, answer, *args):
        self.seen.append((prompt, answer))
        return None, None


def online_order(cfg, dp: int, steps: int) -> list:
    """The (prompt, answer) pairs train --online draws, in the dataset path's row order (rank-major
    within a step); a block's prompts once (replay.reuse_steps repeats them)."""
    online = OnlineGroups(cfg)
    online.task = Recorder(online.task)
    for step in range(1, steps + 1):
        if (step - 1) % cfg.replay.reuse_steps == 0:
            for rank in range(dp):
                online.groups(object(), step, rank, dp, cfg.train.groups_per_step)
    return online.task.seen


def make_dataset(tmp_path, task: str, config: str, overrides: list[str], dp: int = 2, steps: int = 5):
    out, config = tmp_path / task, str(ROOT / config)
    load(f"{task}/make_dataset.py").main(["--config", config, "--dp", str(dp), "--steps", str(steps), "--out",
                                          str(out), "--heldout", "6", *overrides])
    tok = transformers.AutoTokenizer.from_pretrained(out / "tokenizer")
    cfg = load_config(config, overrides)
    return out, tok, cfg


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_key_recall_rows_are_the_online_prompts(tmp_path):
    out, tok, cfg = make_dataset(tmp_path, "key_recall", "configs/demo-key-recall.yaml", ORDER + ["task.key_len=3"])
    train, held = read(out / "train.jsonl"), read(out / "heldout.jsonl")
    want = online_order(cfg, dp=2, steps=5)
    assert len(train) == len(want) == 3 * 2 * 3   # 3 blocks (steps 1-2, 3-4, 5) x dp 2 x 3 groups
    for row, (prompt, key) in zip(train, want):
        assert ids(tok, row["prompt"]) == prompt and ids(tok, row["key"]) == key
    assert {len(ids(tok, r["prompt"])) <= 32 for r in train[:6]} == {True}   # block 1: the curriculum's start
    online = OnlineGroups(cfg)
    for k in (0, 5, 6, 17):   # OnlineGroups.example(k, lengths) directly: block k // 6 starts at step 2 * block + 1
        assert (ids(tok, train[k]["prompt"]), ids(tok, train[k]["key"])) == online.example(
            k, cfg.task.lengths(k // 6 * 2 + 1))
    for j, row in enumerate(held):
        assert (ids(tok, row["prompt"]), ids(tok, row["key"])) == online.example(-1 - j)
    assert tok.eos_token is None and len(tok) == cfg.model.vocab_size


def test_key_recall_reward_equals_builtin(tmp_path):
    out, tok, cfg = make_dataset(tmp_path, "key_recall", "configs/demo-key-recall.yaml", ["task.key_len=3"], steps=1)
    reward = load("key_recall/reward.py").reward
    rng = random.Random(0)
    for row in read(out / "train.jsonl")[:20]:
        key = ids(tok, row["key"])
        # random responses of 0..5 tokens, some starting with the key's prefix (partial credit)
        responses = [key[:rng.randint(0, 3)] + [rng.randrange(cfg.model.vocab_size) for _ in range(rng.randint(0, 2))]
                     for _ in range(8)] + [key, key + [1], []]
        got = reward([tok.decode(r) for r in responses], row)
        assert got == [key_recall.reward(r, key) for r in responses]


def test_tool_lookup_rows_and_env(tmp_path):
    out, tok, cfg = make_dataset(tmp_path, "tool_lookup", "configs/demo-tool-lookup.yaml",
                                 ORDER[:3] + ["task.start_len=[12,16]"])
    train, held = read(out / "train.jsonl"), read(out / "heldout.jsonl")
    want = online_order(cfg, dp=2, steps=5)
    assert len(train) == len(want) == 5 * 2 * 3
    for row, (prompt, secret) in zip(train, want):
        assert ids(tok, row["prompt"]) == prompt and ids(tok, row["secret"]) == [secret]
        assert row["secret"] not in row["prompt"].split()
    online = OnlineGroups(cfg)
    for j, row in enumerate(held):
        assert (ids(tok, row["prompt"]), ids(tok, row["secret"])[0]) == online.example(-1 - j)
    env = load("tool_lookup/env.py").ToolLookupEnv()
    rng, V = random.Random(0), cfg.model.vocab_size
    for row in train[:10]:
        secret = ids(tok, row["secret"])[0]
        for _ in range(4):
            call, answer = rng.randrange(V), rng.choice([secret, rng.randrange(V)])
            env.reset(row)
            obs, done, r1 = env.step(tok.decode([call]))
            assert (ids(tok, obs), done, r1) == ([secret], False, 0.0)
            obs, done, r2 = env.step(tok.decode([answer]))
            assert (obs, done) == ("", True)
            assert r1 + r2 == tool_lookup.reward([call, secret, answer], secret)


def test_coding_reward_runs_the_code(tmp_path):
    out = tmp_path / "coding"
    load("coding/make_dataset.py").main(["--out", str(out), "--train", "12", "--heldout", "4", "--vocab", "400"])
    tok = transformers.AutoTokenizer.from_pretrained(out / "tokenizer")
    reward = load("coding/reward.py").reward
    assert tok.eos_token == "<|endoftext|>" and len(tok) <= 400
    rows = read(out / "train.jsonl") + read(out / "heldout.jsonl")
    assert len(rows) == 16
    for row in rows[:6]:
        a = row["answer"]
        assert a in "12345678" and [c for c in row["prompt"] if c in "123456789"] == [a]
        assert row["prompt"] == "".join(f"# file: {p}\n{s}\n" for p, s in row["files"].items()) + \
            f"What does {row['function'].rsplit('.', 1)[1]}('a') return?\nAnswer: "
        p = ids(tok, row["prompt"])
        assert tok.decode(p) == row["prompt"] and p.count(ids(tok, a)[0]) == 1 and len(ids(tok, a)) == 1
        wrong = str(int(a) % 8 + 1)
        assert reward([a, f" {a}\nmore", a + "<|endoftext|>", wrong, "", f"{a}{a}"], row) == [1, 1, 1, 0, 0, 0]
        # the same row with another digit in its code: the reward follows the code, not row["answer"]
        moved = dict(row, files={k: v.replace(a, wrong) for k, v in row["files"].items()})
        assert reward([a, wrong], moved) == [0.0, 1.0]
