"""A multi-turn environment under TP=2 and CP=2 against one rank (float64, weights from a Hugging Face
directory): `longstraw rollout --dataset --env` samples three policy turns (one token each) with two observations
between them (tests/own_task/envs.py) at each layout, and at PP=2 x VPP=2 (model chunks through Megatron's
interleaved schedule, one forward-only micro-batch per token): the same tokens, loss masks and rewards, log-probs
within 1e-10; the observations are loss-masked where the environment put them. `longstraw validate`
then replays the one-rank episodes at each layout: loss, log-probs and every gradient within 1e-10 of
one rank, and turns that several episodes made alike replayed once (the receipt's replayed_tokens equals
the prefix trie's token count, counted independently, below the response tokens).

Why the layouts must agree: sampling draws its uniform numbers from (seed, prompt index) on every rank
and the environment runs on each replica's first rank, its observations broadcast, so the episodes
depend only on the logits, which agree to rounding (float64). Not covered: data parallelism (rows split by
index, as `longstraw rollout` splits prompts)."""

from __future__ import annotations

import json

import pytest

from launch import longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

LAYOUTS = {"one rank": (1, []), "tp=2": (2, ["parallel.tp=2"]), "cp=2": (2, ["parallel.cp=2"])}
SAMPLED_ONLY = {"pp=2 x vpp=2": (2, ["parallel.pp=2", "parallel.vpp=2"])}
"""Layouts that sample (`longstraw rollout`) but do not train yet (interleaved stages: commands/preflight.py)."""
SAMPLING = ["rollout.max_tokens=1", "rollout.group_size=8", "rollout.temperature=0.6", "env.max_turns=3",
            "device=cpu", "replay.chunk_len=7", "reward.workers=1"]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    import random

    from hf_reference import build_hf_model, tiny_model_config

    from longstraw_mcore.tasks.tokenizer_build import word_tokenizer

    tmp = tmp_path_factory.mktemp("env_layouts")
    m = tiny_model_config()
    build_hf_model(m, seed=5).save_pretrained(tmp / "hf")
    words = [f"w{i}" for i in range(m.vocab_size)]
    word_tokenizer(words, tmp / "tok")
    rng = random.Random(2)
    with open(tmp / "rows.jsonl", "w") as f:
        for _ in range(6):
            f.write(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(12, 20))),
                                "tag": rng.choice(words)}) + "\n")
    return tmp, m


def _rows(path):
    return [json.loads(x) for x in open(path) if x.strip()]


def test_episodes_and_gradients_equal_across_layouts(case):
    from safetensors.torch import load_file

    from tree_groups import trie_tokens

    tmp, m = case
    got = {}
    for name, (n, over) in {**LAYOUTS, **SAMPLED_ONLY}.items():
        out = tmp / f"r-{n}-{'-'.join(over) or 'one'}.jsonl"
        r = longstraw(n, "rollout", "--hf", str(tmp / "hf"), "--dataset", str(tmp / "rows.jsonl"), "--tokenizer",
                      str(tmp / "tok"), "--env", "tests.own_task.envs:Echo", "--out", str(out), *SAMPLING, *over,
                      timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        got[name] = _rows(out)
    ref = got["one rank"]
    tag_ids = [int(row["row"]["tag"][1:]) for row in ref]
    for g, tag in zip(ref, tag_ids):
        for resp, mask in zip(g["responses"], g["loss_masks"]):
            # turn (1 token) obs (2) turn obs (2) turn: observations masked, the row's tag first in each
            assert mask == [1, 0, 0, 1, 0, 0, 1], mask
            assert resp[1] == tag and resp[4] == tag
            assert resp[2] == resp[0] and resp[5] == resp[3]   # the echoed word of the turn before
    for name in ("tp=2", "cp=2", *SAMPLED_ONLY):
        for a, b in zip(got[name], ref):
            assert a["responses"] == b["responses"] and a["loss_masks"] == b["loss_masks"], name
            assert a["rewards"] == b["rewards"], name
            worst = max(abs(x - y) for la, lb in zip(a["old_logprobs"], b["old_logprobs"]) for x, y in zip(la, lb))
            assert worst <= 1e-10, (name, worst)
    receipts, grads = {}, {}
    for name, (n, over) in LAYOUTS.items():
        out = tmp / f"v-{name.replace('=', '')}"
        r = longstraw(n, "validate", "--hf", str(tmp / "hf"), "--rollouts", str(tmp / "r-1-one.jsonl"), "--out",
                      str(out), "--mode", "exact", "--dump-grads", "device=cpu", "replay.chunk_len=7", *over,
                      timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        receipts[name] = json.loads((out / "receipt.json").read_text())
        grads[name] = load_file(str(out / "grads.safetensors"))
    base, bg = receipts["one rank"], grads["one rank"]
    trained = [i for i, lp in enumerate(base["logprobs"]) if lp is not None]   # (equal rewards: no advantage)
    assert len(trained) >= 2, base["logprobs"]
    for name in ("tp=2", "cp=2"):
        rc, g = receipts[name], grads[name]
        assert [i for i, lp in enumerate(rc["logprobs"]) if lp is not None] == trained, name
        loss = abs(rc["loss"] - base["loss"])   # (on-policy: the ratio is 1, advantages sum to 0, the loss ~1e-16)
        lp = max(abs(x - y) for i in trained for a, b in zip(rc["logprobs"][i], base["logprobs"][i])
                 for x, y in zip(a, b))
        worst = max(float((g[k] - bg[k]).abs().max() / bg[k].abs().max()) for k in bg)
        print(f"{name} vs one rank: loss {loss:.1e}, logp {lp:.1e}, worst of {len(bg)} gradients {worst:.1e}")
        assert loss <= 1e-12 and lp <= 1e-10 and worst <= 1e-10 and rc["grad_norm"] > 0
    trie = sum(trie_tokens(ref[i]["responses"]) for i in trained)
    total = sum(len(r) for i in trained for r in ref[i]["responses"])
    print(f"replayed {base['replayed_tokens']} of {total} response tokens (trie {trie})")
    assert base["replayed_tokens"] == trie < total
