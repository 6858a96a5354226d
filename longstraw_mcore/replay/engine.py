"""Branch replay of one prompt group: capture the prompt once, replay each branch, exact sweep.

    capture : prompt[:-1] under no_grad, `chunk_len` tokens at a time -> PromptState
              (peak activations: one chunk; exact mode also keeps the GDN state entering each chunk)
    replay  : for each branch b, [prompt[-1]] + y_b[:-1] at positions P-1.. with autograd against the
              state -> log-probs of y_b -> its loss term -> backward; its graph (the branch's own K/V
              and recurrent updates: its scratch) is freed before the next branch
    exact   : state tensors are leaves during replay, their gradients accumulate over branches; then
              chunks are recomputed from last to first with autograd against the earlier chunks'
              state, seeded with the accumulated gradient of the chunk's own K/V and of the GDN state
              leaving it; one torch.autograd.backward per chunk deposits into the parameters and the
              earlier chunks' state gradients. A chunk's recompute stops as soon as the last layer has
              written its state: nothing after it is seeded.

detached = sum_b dL_b/dtheta with the state held constant (LongStraw's truncated gradient);
exact    = dL/dtheta including (sum_b dL_b/dS) dS/dtheta, i.e. full-sequence GRPO.
Runs on pipeline-parallel size 1 (TP any); the objective is given as per-branch terms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from longstraw_mcore.config import ReplayConfig
from longstraw_mcore.loss.logprobs import token_logprobs
from longstraw_mcore.models.mixers.gated_attention import GatedAttentionMixer
from longstraw_mcore.models.mixers.state import AttentionState, GDNState
from longstraw_mcore.prompt_state.containers import AttentionLayerBuffer, PromptState, allocate
from longstraw_mcore.prompt_state.contexts import (CaptureContext, RecomputeContext, ReplayContext, StateComplete,
                                                   ensure_grad, make_leaves)


def _local_layers(model) -> dict[int, str]:
    types = model.model_cfg.layer_types
    return {layer.layer_number: types[layer.layer_number - 1] for layer in model.decoder.layers}


def _unwrap(model):
    return getattr(model, "module", model)


@torch.no_grad()
def capture(model, prompt_prefix: torch.Tensor, cfg: ReplayConfig, tp: int) -> PromptState:
    """Run `prompt_prefix` [1, P-1] through the model chunk by chunk, keeping only the prompt state."""
    core = _unwrap(model)
    n = prompt_prefix.shape[1]
    state = allocate(core.model_cfg, _local_layers(core), tp, n, prompt_prefix.device)
    exact = cfg.mode == "exact"
    for s0 in range(0, n, cfg.chunk_len):
        s1 = min(n, s0 + cfg.chunk_len)
        model(prompt_prefix[:, s0:s1], state=CaptureContext(state, s0, keep_boundaries=exact), hidden_only=True)
        state.chunk_bounds.append((s0, s1))
        state.length = s1
    return state


@dataclass
class BranchResult:
    logprobs: torch.Tensor          # [R] detached
    stats: dict = field(default_factory=dict)


BranchLoss = Callable[[int, torch.Tensor], tuple[torch.Tensor, dict]]


def attention_probs_bytes(local_q_heads: list[int], batch: int, tokens: int, prompt_len: int,
                          dtype: torch.dtype) -> int:
    """Bytes a branch (batch x tokens) keeps when it stores its probabilities over `prompt_len`
    cached positions in each local attention layer (`local_q_heads` per layer; float32, or float64)."""
    item = 8 if dtype == torch.float64 else 4
    return sum(local_q_heads) * batch * tokens * prompt_len * item


def stores_attention_probs(model, captured: int, cfg: ReplayConfig, batch: int, tokens: int) -> bool:
    """Whether a branch of `batch` x `tokens` against `captured` prompt positions keeps its attention
    probabilities for the backward (they fit `cfg.attn_probs_budget_mib`) instead of recomputing them."""
    if cfg.attn_probs_budget_mib <= 0 or captured == 0:
        return False
    core = _unwrap(model)
    heads = [layer.self_attention.hq for layer in core.decoder.layers
             if isinstance(layer.self_attention, GatedAttentionMixer)]
    need = attention_probs_bytes(heads, batch, tokens, captured, next(core.parameters()).dtype)
    return need <= cfg.attn_probs_budget_mib * 2**20


def _branch_inputs(prompt_last: int, response: list[int], device):
    ids = torch.tensor([[prompt_last] + response[:-1]], device=device)
    tgt = torch.tensor([response], device=device)
    return ids, tgt


def replay_branches(model, state: PromptState, prompt_last: int, responses: list[list[int]], order: list[int],
                    loss_fn: BranchLoss | None, cfg: ReplayConfig, leaves: dict | None = None) -> list[BranchResult]:
    """Replay branches (one at a time, or batched) and back-propagate each branch's loss term.

    `loss_fn(b, logp [R_b])` returns (scalar, stats); None scores without autograd."""
    core = _unwrap(model)
    device = next(core.parameters()).device
    results: dict[int, BranchResult] = {}
    grad = loss_fn is not None
    if cfg.batch_branches:
        G, Rmax = len(order), max(len(responses[b]) for b in order)
        ids = torch.zeros(G, Rmax, dtype=torch.long, device=device)
        tgt = torch.zeros(G, Rmax, dtype=torch.long, device=device)
        for i, b in enumerate(order):  # right padding: causal, so pads never reach real positions
            r = responses[b]
            ids[i, :len(r)] = torch.tensor([prompt_last] + r[:-1])
            tgt[i, :len(r)] = torch.tensor(r)
        with torch.set_grad_enabled(grad):
            store = grad and stores_attention_probs(core, state.length, cfg, G, Rmax)
            hidden = model(ids, state=ReplayContext(state, leaves, batch=G, store_probs=store), hidden_only=True)
            logp = token_logprobs(core.output_layer, hidden, tgt, cfg.logprob_chunk)
            total = 0
            for i, b in enumerate(order):
                lp = logp[i, :len(responses[b])]
                if grad:
                    loss, stats = loss_fn(b, lp)
                    total = total + loss
                else:
                    stats = {}
                results[b] = BranchResult(lp.detach(), stats)
            if grad:
                total.backward()
        return [results[b] for b in sorted(results)]
    for b in order:
        ids, tgt = _branch_inputs(prompt_last, responses[b], device)
        with torch.set_grad_enabled(grad):
            store = grad and stores_attention_probs(core, state.length, cfg, 1, ids.shape[1])
            hidden = model(ids, state=ReplayContext(state, leaves, store_probs=store), hidden_only=True)
            lp = token_logprobs(core.output_layer, hidden, tgt, cfg.logprob_chunk)[0]
            stats = {}
            if grad:
                loss, stats = loss_fn(b, lp)
                loss.backward()  # frees this branch's graph (its scratch) before the next branch
        results[b] = BranchResult(lp.detach(), stats)
    return [results[b] for b in sorted(results)]


def exact_prompt_backward(model, state: PromptState, prompt_prefix: torch.Tensor, leaves: dict) -> None:
    """Reverse sweep over capture chunks, injecting the accumulated state gradients (see module doc)."""
    carried: dict[int, GDNState] = {}
    for n, leaf in leaves.items():
        if isinstance(leaf, AttentionLayerBuffer) or leaf is None:
            continue
        carried[n] = GDNState(conv=ensure_grad(leaf.conv.grad, leaf.conv),
                              recurrent=ensure_grad(leaf.recurrent.grad, leaf.recurrent))
    for c in reversed(range(len(state.chunk_bounds))):
        s0, s1 = state.chunk_bounds[c]
        ctx = RecomputeContext(state, c)
        with torch.enable_grad():
            try:
                model(prompt_prefix[:, s0:s1], state=ctx, hidden_only=True)
                raise AssertionError("the recompute forward ended without every layer writing its state")
            except StateComplete:
                pass
        outs, grads = [], []
        for n, produced in ctx.produced.items():
            st = state.layers[n]
            if isinstance(produced, AttentionState):
                outs += [produced.k, produced.v]
                # cloned: this backward accumulates into the same .grad tensors (at earlier positions)
                grads += [ensure_grad(st.k.grad, st.k)[:, s0:s1].clone(), ensure_grad(st.v.grad, st.v)[:, s0:s1].clone()]
            else:
                outs += [produced.conv, produced.recurrent]
                grads += [carried[n].conv, carried[n].recurrent]
        torch.autograd.backward(outs, grads)
        for n, entry in ctx.entry.items():
            if entry is not None:
                carried[n] = GDNState(conv=ensure_grad(entry.conv.grad, entry.conv),
                                      recurrent=ensure_grad(entry.recurrent.grad, entry.recurrent))
    for st in state.layers.values():  # the state gradient is spent: release it
        if isinstance(st, AttentionLayerBuffer):
            st.k.grad = None
            st.v.grad = None


def run_group(model, prompt: list[int], responses: list[list[int]], loss_fn: BranchLoss, cfg: ReplayConfig,
              tp: int, order: list[int] | None = None, timed: bool = False):
    """Capture, replay every branch with `loss_fn`, and (exact mode) the prompt backward.

    Returns (results, state) or, with `timed`, (results, state, seconds per phase)."""
    core = _unwrap(model)
    device = next(core.parameters()).device
    clock = [time.perf_counter()]
    seconds = {}

    def lap(name):
        now = time.perf_counter()
        seconds[name] = now - clock[0]
        clock[0] = now

    prefix = torch.tensor([prompt[:-1]], device=device, dtype=torch.long)
    state = capture(model, prefix, cfg, tp)
    lap("capture")
    leaves = make_leaves(state) if cfg.mode == "exact" else None
    order = list(range(len(responses))) if order is None else order
    results = replay_branches(model, state, prompt[-1], responses, order, loss_fn, cfg, leaves)
    lap("replay")
    if cfg.mode == "exact" and state.length > 0:
        exact_prompt_backward(model, state, prefix, leaves)
        lap("prompt_backward")
    return (results, state, seconds) if timed else (results, state)


def score_group(model, prompt: list[int], responses: list[list[int]], cfg: ReplayConfig, tp: int,
                state: PromptState | None = None) -> tuple[list[torch.Tensor], PromptState]:
    """Per-token log-probs of every branch without autograd (old / reference scoring)."""
    core = _unwrap(model)
    device = next(core.parameters()).device
    if state is None:
        prefix = torch.tensor([prompt[:-1]], device=device, dtype=torch.long)
        state = capture(model, prefix, ReplayConfig(mode="detached", chunk_len=cfg.chunk_len), tp)
    res = replay_branches(model, state, prompt[-1], responses, list(range(len(responses))), None, cfg)
    return [r.logprobs for r in res], state
