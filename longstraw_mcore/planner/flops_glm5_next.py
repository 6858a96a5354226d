"""FLOP terms of GLM-5.3-Flash's layers (planner/flops.py's `LayerFlops`), on one rank: what `FlopCounterMode`
counts on the code path (tests/unit/test_flop_model.py holds it to equality on the tiny config).

Every layer has two hyper-connected sublayers (models/hyper_connection.py), each per token (N streams of H):

    hyper-connection   the mixing weights f fn^T, 2 N H (N + 2) N; the streams' mix comb^T streams, 2 N^2 H
                       (replicated over TP: every rank runs them on all its tokens)

    KDA (Kimi Delta Attention)   q, k, v, o projections 4 H D, the low-rank gate and output-gate halves 2 (H K + K D),
                       beta H h; its chunked rule is Gated DeltaNet's in FLOPs (ops/kda.py builds its two pairwise
                       [C, C, K] products as one batched product each: the matmul shapes of ops/gated_delta.py's),
                       so planner/flops_hybrid.py's rule, conv and sequence-piece terms apply with H_k = H_v = h
    MLA + DSA          GLM-5.2's (planner/flops_mla.py) with no RoPE and a pooled indexer: its scores are per
                       (query, pool), P = S // kpool pools of a key set ending at S (later pools are cut: never a
                       candidate), every rank scoring all of them (the pools are replicated); the gate scores
                       x kpool_gate^T, 2 H Di per token (replicated); the attention's slots are the selection's
                       width min(index_topk / kpool, P) kpool + kpool - 1 (the query's incomplete pool)
    MLP                dense SwiGLU or MoE: planner/flops_mla.py `mlp_flops`

A call with autograd adds twice its forward (the indexer excepted), and each hyper-connection's weights once more
(recomputed in its backward). The model's last layer run only as far as its
state (capture, exact mode's recompute) runs its attention sublayer's hyper-connection weights and norm (not the
mix), and its state's projections: KDA q, k, v, f_a, f_b, b; MLA kv_a_proj (and a full layer's indexer key and
gate scores, without autograd).
"""

from __future__ import annotations

from longstraw_mcore.planner.flops_hybrid import GatedDeltaNetFlops
from longstraw_mcore.planner.flops_mla import MLADSAFlops, _stripe, mlp_flops


def hc_flops(m, T: int, mix: bool = True) -> float:
    """One sublayer's hyper-connection on T tokens, forward: its weights and (`mix`) the streams' mix."""
    N, H = m.hc_mult, m.hidden_size
    return 2.0 * T * N * H * ((N + 2) * N + (N if mix else 0))


def _below(U: int, kp: int, cap: int | None = None) -> int:
    """sum over u in [0, U) of floor(u / kp), each capped at `cap`."""
    if U <= 0:
        return 0
    if cap is not None and U > cap * kp:
        return _below(cap * kp, kp) + (U - cap * kp) * cap
    q, r = divmod(U, kp)
    return kp * q * (q - 1) // 2 + r * q


def _mods(U: int, kp: int) -> int:
    """sum over u in [0, U) of u mod kp."""
    q, r = divmod(max(U, 0), kp)
    return q * kp * (kp - 1) // 2 + r * (r - 1) // 2


def hc_recompute(m, T: int, sublayers: int = 2) -> float:
    """Under autograd each hyper-connection recomputes its weights in the backward (models/hyper_connection.py):
    one more f fn^T per sublayer."""
    return sublayers * hc_flops(m, T, mix=False)


class KDAFlops(GatedDeltaNetFlops):
    @staticmethod
    def _proj(m, tp: int) -> tuple[int, int]:
        """(this rank's projection weights, of those the last layer's recompute leaves out)."""
        H, K, h = m.hidden_size, m.linear_head_dim, m.linear_num_heads
        D = h * K
        out = H * K + K * D + D * H  # g_a, g_b, o
        return (3 * H * D + 2 * (H * K + K * D) + H * h + D * H) // tp, out // tp

    def _linear(self, m, tp, layer, T, last=False):
        W, pruned = self._proj(m, tp)
        if last:
            return 2.0 * (W - pruned) * T + hc_flops(m, T, mix=False)
        return 2.0 * W * T + mlp_flops(m, tp, layer, T) + 2 * hc_flops(m, T)

    def replay(self, m, tp, layer, R, Pc, exact, store_probs, kind, path=(), seeded=False):
        return super().replay(m, tp, layer, R, Pc, exact, store_probs, kind, path, seeded) + hc_recompute(m, R)

    def recompute(self, m, tp, layer, s, e, last, kind, cp=1):
        return super().recompute(m, tp, layer, s, e, last, kind, cp) + hc_recompute(m, e - s, 1 if last else 2)

    def naive(self, m, tp, layer, T, kind):
        return super().naive(m, tp, layer, T, kind) + hc_recompute(m, T)


class MLAKpoolFlops(MLADSAFlops):
    def _linear(self, m, tp, layer, T):
        return super()._linear(m, tp, layer, T) + 2 * hc_flops(m, T)

    def _index(self, m, tp, T, pairs):
        if not self.indexer:
            return 0.0
        return super()._index(m, tp, T, pairs) + 2.0 * T * m.hidden_size * m.index_head_dim

    def _call(self, m, tp, layer, T, start, S, kind, grad, rows=None):
        """As MLADSAFlops._call, with pools: the selection's width and the indexer's (query, pool) pairs."""
        if kind == "minimum" and tp > 1:
            return self._call(m, 1, layer, T, start, S, kind, grad) / tp
        kp, n = m.index_kpool, m.index_topk // m.index_kpool
        h, R = m.num_attention_heads // tp, m.kv_lora_rank
        heads = h if rows is None else m.num_attention_heads
        if kind == "algorithm":
            slots, pairs = T * (min(n, S // kp) * kp + kp - 1), T * (S // kp)
        else:  # each query's valid slots (its chosen pools' tokens and its incomplete pool), its visible pools
            u0, u1 = start + 1, start + T + 1
            slots = kp * (_below(u1, kp, n) - _below(u0, kp, n)) + _mods(u1, kp) - _mods(u0, kp)
            pairs = _below(u1, kp) - _below(u0, kp)
        attn = 2.0 * (T * heads * m.qk_nope_head_dim * R + slots * heads * 2 * R + T * h * R * m.v_head_dim)
        return ((self._linear(m, tp, layer, T) + attn) * (3 if grad else 1) + self._index(m, tp, T, pairs)
                + (hc_recompute(m, T) if grad else 0.0))

    def capture(self, m, tp, layer, chunks, kind, last=False, cp=1):
        if not last:
            return super().capture(m, tp, layer, chunks, kind, last, cp)
        return sum(self._state_only(m, tp, e - s) for s, e in chunks)

    def _state_only(self, m, tp: int, T: int) -> float:
        """The last layer's forward as far as its state: attention hyper-connection, kv_a_proj (and a full layer's
        indexer key and gate scores)."""
        H = m.hidden_size
        out = 2.0 * T * (H * m.kv_lora_rank // tp) + hc_flops(m, T, mix=False)
        return out + (2.0 * T * (H * m.index_head_dim // tp + H * m.index_head_dim) if self.indexer else 0.0)

    def recompute(self, m, tp, layer, s, e, last, kind, cp=1):
        if not last:
            return super().recompute(m, tp, layer, s, e, last, kind, cp)
        T, H = e - s, m.hidden_size
        grad = 2 * (2.0 * T * (H * m.kv_lora_rank // tp) + hc_flops(m, T, mix=False))
        return self._state_only(m, tp, T) + grad + hc_recompute(m, T, 1)


__all__ = ["KDAFlops", "MLAKpoolFlops", "hc_flops", "_stripe"]
