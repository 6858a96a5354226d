"""Multi-turn episodes sampled against one captured prompt state (`--env`: tasks/text_task.py).

    prompt  ->  turn 1 (sampled)  obs 1 (the environment's, loss mask 0)  turn 2  obs 2 ...  turn T

The prompt is captured once. A policy turn grows one token per step against the prompt state and the
episode's history so far, held as shared segments (prompt_state/segments.py): after each turn the
turn's tokens and the observation's are recorded once, without autograd, below the branch's path (as
tree sampling records a split), so a turn never replays the prompt nor re-runs earlier turns; branches
whose histories are equal share one path and sample their next turns as one batch. The training side
replays the finished trajectories as a prefix tree (replay/tree.py): turns several branches made alike
are replayed once.

Random numbers: turn t draws [max_tokens, G] uniforms from the generator keyed by (seed, prompt index),
whatever stopped; branch b's step s uses u[s, b]: every rank of every layout samples the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from longstraw_mcore.config import ReplayConfig, RolloutConfig


@dataclass
class Episodes:
    responses: list[list[int]]          # per branch: turns and observations after the prompt
    loss_masks: list[list[int]]         # 1 on the policy's tokens, 0 on observations
    logprobs: list[list[float]]         # the sampled tokens' log-probs (0.0 on observations)
    turns: list[list[list[int]]] = field(default_factory=list)   # per branch: its policy turns
    truncated: int = 0                  # episodes cut at env.max_tokens
    state: object = None


@torch.no_grad()
def sample_episodes(model, prompt: list[int], cfg: RolloutConfig, replay: ReplayConfig, index: int,
                    respond: Callable[[int, list[int], list[list[int]]], list[tuple[list[int], bool]]],
                    max_turns: int, max_tokens: int = 0, state=None) -> Episodes:
    """G = cfg.group_size episodes of up to `max_turns` policy turns (each up to cfg.max_tokens tokens).
    `respond(turn, branches, turn_tokens)` gives each listed branch's (observation ids, done) after its
    turn (the same on every rank). `max_tokens` (> 0) bounds an episode's tokens after the prompt."""
    from longstraw_mcore.prompt_state.contexts import ReplayContext
    from longstraw_mcore.prompt_state.segments import SegmentPath
    from longstraw_mcore.rollout.sampler import grow, start
    from longstraw_mcore.rollout.tree_sampler import record_segment

    if cfg.branch_at:
        raise ValueError("sample_episodes: rollout.branch_at (tree sampling) does not apply to episodes")
    core, state, layout, gen = start(model, prompt, cfg, replay, index, state)
    device = next(core.parameters()).device
    G = cfg.group_size
    out = Episodes([[] for _ in range(G)], [[] for _ in range(G)], [[] for _ in range(G)],
                   [[] for _ in range(G)], state=state)
    paths: dict[tuple, list] = {(): []}     # a history (tokens after the prompt) -> its segments
    live = list(range(G))
    for turn in range(max_turns):
        u = torch.rand(cfg.max_tokens, G, generator=gen, dtype=torch.float64)
        by_hist: dict[tuple, list[int]] = {}
        for b in live:
            by_hist.setdefault(tuple(out.responses[b]), []).append(b)
        new: dict[int, tuple[list[int], list[float]]] = {}
        for hist, bs in by_hist.items():
            room = cfg.max_tokens if not max_tokens else min(cfg.max_tokens, max_tokens - len(hist))
            stack = SegmentPath()
            stack.stack = list(paths[hist])
            step = iter(range(cfg.max_tokens))
            toks, lps = grow(model, core, [[hist[-1] if hist else prompt[-1]]] * len(bs), cfg, room,
                             lambda n: ReplayContext(state, batch=n, store_probs=False, layout=layout, path=stack),
                             lambda: u[next(step), bs])
            new.update({b: (t, lp) for b, t, lp in zip(bs, toks, lps)})
        replies = respond(turn, live, [new[b][0] for b in live])
        still = []
        for b, (obs, done) in zip(live, replies):
            toks, lps = new[b]
            hist = tuple(out.responses[b])
            out.turns[b].append(toks)
            out.responses[b] += toks
            out.loss_masks[b] += [1] * len(toks)
            out.logprobs[b] += lps
            left = max_tokens - len(out.responses[b]) if max_tokens else len(obs) + 1
            if done or turn == max_turns - 1 or left <= len(obs):
                out.truncated += int(not done and turn < max_turns - 1)
                continue    # (an observation no turn reads is not kept)
            out.responses[b] += obs
            out.loss_masks[b] += [0] * len(obs)
            out.logprobs[b] += [0.0] * len(obs)
            key = tuple(out.responses[b])
            if key not in paths:
                inputs = [hist[-1] if hist else prompt[-1]] + (toks + obs)[:-1]
                paths[key] = paths[hist] + [record_segment(model, core, state, layout, paths[hist], len(hist),
                                                           inputs, device)]
            still.append(b)
        live = still
        if not live:
            break
    return out
