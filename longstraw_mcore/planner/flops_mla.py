"""FLOP terms of GLM-5.x's MLA + DSA layers with their dense or MoE MLP (planner/flops.py's
`LayerFlops`), on one rank: what `FlopCounterMode` counts on the code path (tests/unit/test_flop_model.py
holds it to equality on the tiny GLM config at TP = 1).

Per token of a call of T tokens whose queries see S keys (the call's key set: a capture chunk ending at
e sees S = e, a branch S = Pc + R, a full sequence S = T), with k = min(index_topk, S) selected slots:

    projections   kv_a_proj_with_mqa H (R + Dr), q_a_proj H Q, q_b_proj Q h (Dn + Dr), o_proj h Dv H
    attention     q in latent space h Dn R, logits to the k selected latents and RoPE keys h k (R + Dr),
                  their weighted sum h k R, W_UV h R Dv (absorbed MLA: ops/dsa.py)
    indexer       (full layers, no autograd) wk H Di, wq_b Q Hi Di, weights_proj H Hi; the scores against
                  every key of the set S Hi (Di + 1)
    MLP           dense SwiGLU 3 H F; MoE: the router H E, the top-k routed experts' SwiGLUs 3 k_e H I,
                  the shared experts' 3 H I n_s

each 2 FLOPs per multiply-add. A call with autograd adds twice its forward (the gradient of both
operands of every matmul: the selected latents' gradient is taken whole, as the code takes it, also
where they are the detached prompt's), the indexer excepted (it gets no gradient). Every slot of the k
is computed, also a slot beyond a query's visible keys (marked invalid): `minimum` counts only the
min(k, position + 1) valid ones and the indexer's scores of visible keys, and no log-prob recompute.
Exact mode's recompute of the model's last layer stops after its latents (kv_a_proj; on a full layer
also the indexer key, without autograd).

Tensor parallelism, per rank (the largest: rank 0 of the TP group, which keeps the most rows): the
projections split by tp; with a prompt state (capture, replay, the sweep) the latent is striped over
the TP ranks (parallel/cp_dsa.py), so each rank's queries of every head (gathered) meet its stripe in
all index_topk slots of the global selection, and its indexer scores its rows only (ceil(n / tp) of n
positions, plus a call's own rows, which every rank holds); W_UV and o_proj stay per rank. A plain
forward (naive GRPO) keeps the latents whole on every rank: its own heads, the whole indexer. The MoE
block splits its tokens by sequence (ceil(T / tp) each). Context parallelism is not modelled here
(the plan divides by cp).
"""

from __future__ import annotations

from longstraw_mcore.planner.flops import clamped_sum


def _valid_slots(T: int, start: int, k: int) -> int:
    """Sum over the queries at start..start+T-1 of min(k, position + 1)."""
    return clamped_sum(start + 1, start + T + 1, k)


def _visible(T: int, start: int) -> int:
    """Sum over the queries at start..start+T-1 of their visible keys (position + 1)."""
    return T * start + T * (T + 1) // 2


def _stripe(n: int, tp: int) -> int:
    """Rows the largest TP rank (rank 0) keeps of n positions striped over tp (prompt_state/mla.py)."""
    return -(-n // tp)


def mlp_flops(m, tp: int, layer: int, T: int) -> float:
    """Layer `layer`'s dense SwiGLU or MoE block on T tokens, forward, this rank's share (module docstring)."""
    H = m.hidden_size
    if m.mlp_types[layer] == "dense":
        return 2.0 * T * (3 * H * m.intermediate_size // tp)
    I, Tr = m.moe_intermediate_size, -(-T // tp)
    routed = 2.0 * Tr * (H * m.n_routed_experts + 3 * m.num_experts_per_tok * H * I)
    return routed + 2.0 * Tr * tp * (3 * H * I * m.n_shared_experts // tp)


class MLADSAFlops:
    def __init__(self, indexer: bool):
        self.indexer = indexer
        """A full indexer layer (computes its top-k); shared layers reuse the previous full layer's."""

    @staticmethod
    def _linear(m, tp: int, layer: int, T: int) -> float:
        """The projections and the MLP of T tokens on this rank. The MoE layer splits its tokens by
        sequence over TP (padded to a multiple of tp: models/glm_moe.py), its router replicated, its
        experts whole, its shared experts tensor-parallel over the gathered tokens."""
        H, R, Dr, Q, nh = m.hidden_size, m.kv_lora_rank, m.qk_rope_head_dim, m.q_lora_rank, m.num_attention_heads
        proj = 2.0 * T * ((H * (R + Dr) + H * Q + Q * nh * (m.qk_nope_head_dim + Dr) + nh * m.v_head_dim * H) // tp)
        return proj + mlp_flops(m, tp, layer, T)

    def _index(self, m, tp: int, T: int, pairs: int) -> float:
        """The indexer of T queries scoring `pairs` (query, key) pairs (no autograd)."""
        if not self.indexer:
            return 0.0
        H, Q, Hi, Di = m.hidden_size, m.q_lora_rank, m.index_n_heads, m.index_head_dim
        return 2.0 * T * ((H * Di + Q * Hi * Di + H * Hi) // tp) + 2.0 * pairs * Hi * (Di + 1)

    def _call(self, m, tp: int, layer: int, T: int, start: int, S: int, kind: str, grad: bool,
              rows: int | None = None) -> float:
        """T tokens at positions start.. whose queries see a key set of S keys (the set ends at the last).
        `rows`: the key rows this rank holds where the state is striped over TP (tp > 1): every head's
        queries then meet them (gathered over the group) in all index_topk slots of the global
        selection, and the indexer scores only them; None: the key set is whole here. `minimum`: the
        one-rank minimum split evenly over tp."""
        if kind == "minimum" and tp > 1:
            return self._call(m, 1, layer, T, start, S, kind, grad) / tp
        h, nh, R = m.num_attention_heads // tp, m.num_attention_heads, m.kv_lora_rank
        if rows is None:
            k, heads, pairs = min(m.index_topk, S), h, T * S
        else:
            k, heads, pairs = m.index_topk, nh, T * rows
        slots = T * k if kind == "algorithm" else _valid_slots(T, start, k)
        if kind != "algorithm":
            pairs = _visible(T, start)
        attn = 2.0 * (T * heads * m.qk_nope_head_dim * R + slots * heads * (2 * R + m.qk_rope_head_dim)
                      + T * h * R * m.v_head_dim)
        return (self._linear(m, tp, layer, T) + attn) * (3 if grad else 1) + self._index(m, tp, T, pairs)

    def capture(self, m, tp, layer, chunks, kind, last=False, cp=1):
        if last:  # only its latents, RoPE keys and indexer keys (the recompute's forward)
            T, H = sum(e - s for s, e in chunks), m.hidden_size
            return (2.0 * T * (H * (m.kv_lora_rank + m.qk_rope_head_dim) // tp)
                    + (2.0 * T * (H * m.index_head_dim // tp) if self.indexer else 0.0))
        return sum(self._call(m, tp, layer, e - s, s, e, kind, grad=False, rows=_stripe(e, tp) if tp > 1 else None)
                   for s, e in chunks)

    def replay(self, m, tp, layer, R, Pc, exact, store_probs, kind, path=(), seeded=False):
        # a prefix tree's segments above: their latents replicated like the branch's own (not striped)
        d = sum(path)
        return self._call(m, tp, layer, R, Pc + d, Pc + d + R, kind, grad=True,
                          rows=_stripe(Pc, tp) + d + R if tp > 1 else None)

    def recompute(self, m, tp, layer, s, e, last, kind, cp=1):
        if not last:
            return self._call(m, tp, layer, e - s, s, e, kind, grad=True, rows=_stripe(s, tp) + e - s if tp > 1 else None)
        T, H = e - s, m.hidden_size
        latents = 3 * 2.0 * T * (H * (m.kv_lora_rank + m.qk_rope_head_dim) // tp)
        return latents + (2.0 * T * (H * m.index_head_dim // tp) if self.indexer else 0.0)

    def forward(self, m, tp, layer, R, Pc):
        return self._call(m, tp, layer, R, Pc, Pc + R, "minimum", grad=False)

    def naive(self, m, tp, layer, T, kind):
        return self._call(m, tp, layer, T, 0, T, kind, grad=True)  # a plain forward: no state, nothing striped
