"""Softmax attention: the one entry point the models call, and its plain reference twin.

    attention(q, key_sets, q_start) -> (out, lse)

is one causal softmax of the queries over the union of several key sets (the prompt state, the
branch's own keys, later other context-parallel ranks' shards), each a `KeySet` at its own absolute
start position. It runs as one autograd node (`_MergedAttention`): the forward computes each set's
partial (out_j, lse_j) and merges them by log-sum-exp in >= float32; the backward calls each set's
backward with the *merged* out and lse (the ring-attention recipe: p_ij = exp(s_ij - lse_i) on set j,
row term delta_i = rowsum(dO_i * O_i) - dlse_i shared by all sets), so only the merged output is
saved, not one output per set. A set that carries `grad` accumulators (prompt K/V in exact mode)
receives its dK/dV there instead of through autograd: no full-size gradient temporary per call, and
the accumulation dtype is the accumulators' (float32, float64 under float64).
Capture needs no merge: one causal call over the state buffer.

The partial kernels are `ops/block_attention.py` (plain torch: the CPU path and the reference for any
fused kernel) and `ops/flash_attention.py` (torch's flash ops, CUDA bf16/fp16), chosen per call by
`kernel()` (ops/dispatch.py) without touching callers; the merge maths is ops/attention_merge.py.
`block_attention` / `merge_attention` compose one key set's (out, lse) by hand with plain autograd
(tests, and what a merge across ranks builds on).

`cached_causal_attention` materialises the full score matrix against concatenated keys: simple and
obviously right, it is what the blockwise kernels are tested against (tests/unit/test_block_attention.py).
`rope_cos_sin` / `apply_partial_rope` are re-exported from ops/rope.py.

Shapes (package legend): T queries, S keys of a set, P cached (earlier) positions. Scores and softmax
run in at least float32 (float64 under float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw_mcore.ops import dispatch
from longstraw_mcore.ops.attention_merge import backward_terms, merge_partials, unpack_saved, work_dtype
from longstraw_mcore.ops.rope import apply_partial_rope, rope_cos_sin

__all__ = ["KeySet", "attention", "block_attention", "merge_attention", "cached_causal_attention", "kernel",
           "apply_partial_rope", "rope_cos_sin"]


@dataclass
class KeySet:
    """Keys/values [Bk, S, Hk, D] whose key 0 sits at absolute position `start` (Bk = 1 serves every
    query row). `grad = (acc_k, acc_v)`: >= float32 accumulators shaped like k/v that receive dK/dV
    (state gradients); otherwise gradients flow to k/v through autograd when they require them.
    `store_probs`: keep this set's probabilities for the backward (no score recompute; O(T * S)).
    `grad_scale`: factor on what is added to `grad` (context parallelism's exact-mode recompute).
    `local`: this rank holds these positions alone (a sequence shard of the state: context or KV-group
    parallelism); the parallel attention functions merge such sets across ranks."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    grad: tuple[torch.Tensor, torch.Tensor] | None = None
    store_probs: bool = False
    grad_scale: float = 1.0
    local: bool = False

    def __post_init__(self):
        assert self.k.dim() == 4 and self.k.shape[:3] == self.v.shape[:3], (self.k.shape, self.v.shape)


def kernel(q: torch.Tensor):
    """The partial kernels for these queries (ops/dispatch.py: flash on CUDA bf16/fp16, the plain twin
    elsewhere, `ops.attention` overrides)."""
    return dispatch.attention_kernel(q)


class _MergedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cfg, *kv):
        q_start, scale, block, sets = cfg  # sets: ((start, grad, store, grad_scale), ...) per key set
        kern = kernel(q)
        outs, lses, kept = [], [], []
        for j, (start, _, store, _) in enumerate(sets):
            o, lse, kp = kern.partial_forward(q, kv[2 * j], kv[2 * j + 1], q_start, start, scale, block, store)
            outs.append(o)
            lses.append(lse)
            kept.append(kp)
        out, lse = merge_partials(list(zip(outs, lses)), None, work_dtype(q.dtype), q.device)
        out = out.transpose(1, 2).to(q.dtype)                                     # [B,T,Hq,Dv]
        lse = lse.transpose(1, 2).contiguous()                                    # [B,T,Hq]
        # Stored probabilities are saved tensors too: freed by the backward unless retain_graph.
        flat = [t for kp in kept if kp is not None for pair in kp.values() for t in pair]
        # Key sets without a gradient (prompt state: views of its buffers) are held apart from the saved
        # tensors: a capture that keeps its graph (replay.keep_prompt_graph_mib) writes later chunks' rows
        # of those buffers, which would trip the saved views' version check though no read row changes.
        ctx.consts = {i: t for i, t in enumerate(kv) if not t.requires_grad}
        ctx.save_for_backward(q, *[None if i in ctx.consts else t for i, t in enumerate(kv)], out, lse, *flat)
        ctx.cfg, ctx.kept_keys = cfg, [None if kp is None else list(kp) for kp in kept]
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q_start, scale, block, sets = ctx.cfg
        n = len(sets)
        q, kv, out, lse, flat = unpack_saved(ctx.saved_tensors, n)
        kv = [ctx.consts.get(i, t) for i, t in enumerate(kv)]
        work = work_dtype(q.dtype)
        do, delta, lse_h = backward_terms(dout, dlse, out, lse, work)                 # [B,Hq,T,*]
        kern = kernel(q)
        need_q = ctx.needs_input_grad[0]
        dq = None
        grads = []
        it = iter(flat)
        for j, (start, sink, _, sink_scale) in enumerate(sets):
            keys = ctx.kept_keys[j]
            kept = None if keys is None else {key: (next(it), next(it)) for key in keys}
            dqj, dk, dv = kern.partial_backward(q, kv[2 * j], kv[2 * j + 1], do, delta, lse_h, q_start, start,
                                                scale, block, kept, need_q, ctx.needs_input_grad[2 + 2 * j],
                                                ctx.needs_input_grad[3 + 2 * j], sink=sink, sink_scale=sink_scale)
            if dqj is not None:
                dq = dqj if dq is None else dq + dqj
            grads += [None if dk is None else dk.transpose(1, 2).to(kv[2 * j].dtype),
                      None if dv is None else dv.transpose(1, 2).to(kv[2 * j + 1].dtype)]
        if need_q:
            dq = torch.zeros_like(q) if dq is None else dq.transpose(1, 2).to(q.dtype)
        return (dq, None, *grads)


def attention(q: torch.Tensor, key_sets: list[KeySet], q_start: int, scale: float | None = None,
              block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of q [B,T,Hq,D] (query i at `q_start + i`) over the union of
    `key_sets`: (out [B,T,Hq,Dv] in q's dtype, lse [B,T,Hq] in >= float32), both differentiable."""
    if not key_sets:
        raise ValueError("attention: no key sets")
    for ks in key_sets:
        if q.shape[2] % ks.k.shape[2]:
            raise ValueError(f"query heads {q.shape[2]} not a multiple of key heads {ks.k.shape[2]}")
        if ks.k.shape[0] not in (1, q.shape[0]):
            raise ValueError(f"key batch {ks.k.shape[0]} is neither 1 nor the query batch {q.shape[0]}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # probabilities are only worth keeping for a backward (grad mode is off inside Function.forward)
    store = torch.is_grad_enabled()
    sets = tuple((int(ks.start), ks.grad, bool(ks.store_probs) and store, float(ks.grad_scale)) for ks in key_sets)
    kv = [t for ks in key_sets for t in (ks.k, ks.v)]
    return _MergedAttention.apply(q, (int(q_start), scale, int(block), sets), *kv)


def block_attention(q, k, v, q_start: int, k_start: int, scale: float | None = None, block: int = 1024,
                    store_probs: bool = False):
    """(out [B,T,Hq,D], lse [B,T,Hq]) of q against one key set k/v [B,S,Hk,D]; both differentiable.

    Rows that see no key get out = 0 and lse = -inf (they drop out of `merge_attention`)."""
    return attention(q, [KeySet(k, v, k_start, store_probs=store_probs)], q_start, scale=scale, block=block)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]], with_lse: bool = False):
    """Softmax over the union of key sets from per-set (out [B,T,H,D], lse [B,T,H]), by plain autograd:
    out, or (`with_lse`) (out, the merged lse).

    The composable form (each part its own autograd node, lse differentiable): what a merge across
    ranks builds on (parallel/kv_group.py group_cp_attention). Within one rank `attention` merges in
    one node instead."""
    if len(parts) == 1:
        return parts[0] if with_lse else parts[0][0]
    lses = torch.stack([lse for _, lse in parts])                                # [n,B,T,H]
    total = torch.logsumexp(lses, dim=0)
    total_safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    out = 0
    for o, lse in parts:
        w = torch.exp(lse - total_safe)
        out = out + o * w[..., None].to(o.dtype)
    return (out, total) if with_lse else out


def cached_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                            scale: float | None = None) -> torch.Tensor:
    """q [B,T,Hq,D], k/v [B,T,Hk,D], past_k/v [B,P,Hk,D] or None -> out [B,T,Hq,D] (q.dtype)."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    if past_k is not None:
        k = torch.cat([past_k.to(k.dtype), k], dim=1)
        v = torch.cat([past_v.to(v.dtype), v], dim=1)
    P = k.shape[1] - T
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = Hq // Hk
    qh = q.to(work).transpose(1, 2)                                           # [B,Hq,T,D]
    kh = k.to(work).transpose(1, 2).repeat_interleave(rep, dim=1)             # [B,Hq,P+T,D]
    vh = v.to(work).transpose(1, 2).repeat_interleave(rep, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(P + T, device=q.device)[None, :]
    scores = scores.masked_fill(j > i + P, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vh).transpose(1, 2).to(q.dtype)
