"""On-policy sampling from the captured prompt state: the prompt runs once (capture, as branch replay
does), then G responses grow one token per step, each step replaying the branches' tokens so far
against that state without autograd and sampling the next token from the last position's logits.

    capture      prompt[:-1] -> the prompt state (replay/engine.capture; any TP / CP layout)
    step t       ids [G, t+1] = [prompt[-1], y_1 .. y_t] at positions P-1.. -> logits of position P-1+t
                 (full vocabulary: the TP slices gathered) -> y_{t+1} per branch
    record       log_softmax(logits)[y_{t+1}] at temperature 1: the policy's own log-prob of the token
                 (what GRPO's ratio needs as old_logprobs; equal to what replay scoring computes)

Under pipeline parallelism a step is one forward-only micro-batch through the stages (Megatron's
schedule, replay/pipeline.forward_once); the last stage picks the tokens and broadcasts them, with
their log-probs, over the pipeline group, so every stage feeds the same ids to the next step.

With `rollout.branch_at` the group is sampled as a tree (rollout/tree_sampler.py). Each step replays the
whole branch prefix (O(R^2) tokens per branch): the state is shared and
read-only, and responses in RL post-training are short next to the prompt. Sampling is a function of
the logits and of uniform numbers drawn from a generator keyed by (seed, prompt index) on every rank,
so every rank of every layout picks the same tokens from the same logits, without communication;
layouts whose logits differ by rounding agree unless a uniform number falls within that rounding of a
boundary between tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw_mcore.config import ConfigError, ReplayConfig, RolloutConfig
from longstraw_mcore.replay.steps import core_of


@dataclass
class SampledGroup:
    prompt: list[int]
    responses: list[list[int]]
    logprobs: list[list[float]]      # the model's log-prob of each sampled token (temperature 1)
    state: object = None             # the prompt state it sampled against (prompt_state/containers.py)


def full_logits(core, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [B, Hd] (last stage's final-norm output) -> logits [B, V] over the true vocabulary, on every
    TP rank (the output layer's column slices gathered), in >= float32."""
    logits, _ = core.output_layer(hidden)
    tp = core.pg_collection.tp
    if tp.size() > 1:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits, group=tp)
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits[..., :core.model_cfg.vocab_size].to(work)


def choose(logits: torch.Tensor, cfg: RolloutConfig, u: torch.Tensor) -> torch.Tensor:
    """Next tokens [B] from logits [B, V] and uniform numbers u [B] in [0, 1) (ignored when greedy)."""
    if cfg.temperature == 0:
        return torch.argmax(logits, dim=-1)  # the first maximum: ties go to the lowest id
    probs = torch.softmax(logits.double() / cfg.temperature, dim=-1)
    p_sorted, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(p_sorted, dim=-1) - p_sorted          # mass of the more likely tokens
    kept = torch.where(before < cfg.top_p, p_sorted, torch.zeros_like(p_sorted))
    cdf = torch.cumsum(kept, dim=-1)
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[-1] - 1)
    return order.gather(-1, idx).squeeze(-1)


def check_prompt(prompt: list[int], cfg: RolloutConfig, vocab_size: int, where: str) -> None:
    if not 2 <= len(prompt) <= cfg.max_prompt_len:
        raise ConfigError(f"{where}: prompt of {len(prompt)} tokens; rollout needs 2 to rollout.max_prompt_len="
                          f"{cfg.max_prompt_len}")
    bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ConfigError(f"{where}: token id {bad[0]!r} out of range [0, {vocab_size})")


def _pick(core, hidden: torch.Tensor, cfg: RolloutConfig, u: torch.Tensor) -> torch.Tensor:
    """[2, G] float64: the next tokens and their log-probs, from the last stage's output [S, G, Hd]."""
    logits = full_logits(core, hidden[-1])                   # [G, V]
    nxt = choose(logits, cfg, u.to(logits.device))
    lp = torch.log_softmax(logits, dim=-1).gather(-1, nxt[:, None])[:, 0]
    return torch.stack([nxt.double(), lp.double()])      # token ids < 2**53: exact in float64


def _next_tokens(model, core, ids, ctx, cfg: RolloutConfig, u: torch.Tensor):
    pp = core.pg_collection.pp
    if pp.size() == 1:
        picked = _pick(core, core.forward_hidden(ids, ctx), cfg, u)
    else:
        import torch.distributed as dist

        from longstraw_mcore.replay.pipeline import forward_once

        picked = forward_once(model, lambda c: c.forward_hidden(ids, ctx), lambda c, h: _pick(c, h, cfg, u))
        if picked is None:
            picked = torch.empty(2, ids.shape[0], dtype=torch.float64, device=ids.device)
        dist.broadcast(picked, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
    return picked[0].long(), picked[1]


def start(model, prompt: list[int], cfg: RolloutConfig, replay: ReplayConfig, index: int, state):
    """What sampling one prompt begins with: (the model's core, the prompt state: `state`, or captured now
    from prompt[:-1] without autograd, its context-parallel layout, the generator keyed by (seed, index))."""
    from longstraw_mcore.parallel.cp import CPLayout
    from longstraw_mcore.replay.engine import capture

    core = core_of(model)
    check_prompt(prompt, cfg, core.model_cfg.vocab_size, f"prompt {index}")
    if state is None:
        device = next(core.parameters()).device
        state = capture(model, torch.tensor([prompt[:-1]], device=device),
                        ReplayConfig(mode="detached", chunk_len=replay.chunk_len))
    return core, state, CPLayout.of(core.cp_group), torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)


@torch.no_grad()
def sample_group(model, prompt: list[int], cfg: RolloutConfig, replay: ReplayConfig, index: int = 0,
                 state=None, prefixes: list[list[int]] | None = None) -> SampledGroup:
    """G = cfg.group_size responses to `prompt` (prompt index `index` keys the random numbers), against
    `state` (the prompt's captured state, reused: adapter.prompt=frozen) or a fresh capture.
    `prefixes`: each branch's response so far, of one length (a multi-turn episode's earlier turns and
    tool outputs: tasks/tool_lookup.py): sampling continues after them, the responses returned whole,
    the log-probs of the sampled tokens only."""
    from longstraw_mcore.prompt_state.contexts import ReplayContext

    core, state, layout, gen = start(model, prompt, cfg, replay, index, state)
    if prefixes is not None and (len(prefixes) != cfg.group_size or len({len(p) for p in prefixes}) != 1
                                 or cfg.branch_at):
        raise ValueError(f"sample_group: prefixes must be {cfg.group_size} lists of one length, without "
                         f"rollout.branch_at; got lengths {[len(p) for p in prefixes]}")
    if cfg.branch_at:  # a tree: responses share their tokens before each split (rollout/tree_sampler.py)
        from longstraw_mcore.rollout.tree_sampler import sample_tree

        responses, logps = sample_tree(model, prompt, state, cfg, gen, layout,
                                       lambda ids, ctx, u: _next_tokens(model, core, ids, ctx, cfg, u))
        return SampledGroup(prompt=list(prompt), responses=responses, logprobs=logps, state=state)
    G = cfg.group_size
    seqs = [[prompt[-1]] + (list(prefixes[b]) if prefixes is not None else []) for b in range(G)]
    skip = 1 + (len(prefixes[0]) if prefixes is not None else 0)
    grown, logps = grow(model, core, seqs, cfg, cfg.max_tokens,
                        lambda n: ReplayContext(state, batch=n, store_probs=False, layout=layout),
                        lambda: torch.rand(G, generator=gen, dtype=torch.float64))
    responses = [s[1:skip] + g for s, g in zip(seqs, grown)]
    return SampledGroup(prompt=list(prompt), responses=responses, logprobs=logps, state=state)


def grow(model, core, seqs: list[list[int]], cfg: RolloutConfig, steps: int, make_ctx, draw_u):
    """Up to `steps` new tokens for each of the len(seqs) branches, each replaying its `seqs` row (the
    token before its new ones first, all of one length) and what it grew so far, against the context
    `make_ctx(batch)` builds (the prompt state, and a path of shared segments under it); a branch stops at
    a stop id. `draw_u()` gives the step's uniform numbers, one per branch, drawn every step whatever
    stopped. Returns (new tokens, their log-probs) per branch."""
    n, stop = len(seqs), set(cfg.stop_ids)
    device = next(core.parameters()).device
    seqs = [list(s) for s in seqs]
    new: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(steps):
        u = draw_u()
        nxt, lp = _next_tokens(model, core, torch.tensor(seqs, device=device), make_ctx(n), cfg, u)
        for b in range(n):
            tok = int(nxt[b]) if not done[b] else seqs[b][-1]   # finished branches repeat a token, unread
            seqs[b].append(tok)
            if not done[b]:
                new[b].append(tok)
                logps[b].append(float(lp[b]))
                done[b] = tok in stop
        if all(done):
            break
    return new, logps
