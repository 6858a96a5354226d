"""A learned reward: a sequence-classification model's score of every response (`--reward-model`; its layout:
checkpoint/heads.py), by capture + replay without autograd, in place of the rollouts' rewards."""

from __future__ import annotations


def reward_scores(model, groups, rcfg) -> list[list[float]]:
    """Each response's reward-model score: the score at its last token (the sequence-classification
    layout's), by capture + replay without autograd. A response is replayed one token further than a
    policy's (its own last token is an input here), so it is scored as `response + [0]`, the extra
    target unused."""
    from longstraw_mcore.replay.engine import score_group

    out = []
    for g in groups:
        padded = [r + [0] for r in g.responses]
        values, _ = score_group(model, g.prompt, padded, rcfg)
        out.append([float(v[len(r)]) for v, r in zip(values, g.responses)])
    return out
