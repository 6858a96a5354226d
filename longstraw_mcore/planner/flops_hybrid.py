"""FLOP terms of the Qwen3.5/3.6 hybrid's two layer types (planner/flops.py's `LayerFlops`), each with
its SwiGLU MLP, on one TP rank.

    gated attention   q (with its gate), k, v, o projections and the MLP: 2 W T forward, 2 x that backward
                      (dX, dW); the attention core over key blocks: 2 (Hq/tp) D per (query, key) pair and
                      matmul "unit" (forward QK^T and PV: 2 units; backward: the score recompute unless the
                      probabilities are stored, dP, dQ, and dK, dV where the keys need a gradient)
    Gated DeltaNet    q, k, v, z, b, a, out projections and the MLP; the chunked gated delta rule's matmuls
                      per chunk of C (ops/gated_delta.py) and the depthwise conv as FlopCounterMode counts
                      it (its input gradient counted like a dense conv). Under context parallelism by
                      sequence pieces (parallel/cp_gdn.py, where `gdn_by_heads` is false), summed over the
                      cp ranks: every capture / recompute chunk cut into 2 cp pieces, each its own rule
                      run on values K wider (Dk + Dv) from a given state, plus every rank's scan over the
                      2 cp pieces' maps (2 Hv Dk^2 Dv each) and the outputs' correction (2 Hv Dk Dv per
                      token), less in the sweep the gradient of the prompt's zero entering state;
                      equal to FlopCounterMode's count summed over the ranks (capture and exact sweep:
                      tests/dist/test_cp_sequence_gdn.py)

The capture and exact mode's recompute of the model's last layer run only as far as its state
(forward_state): the rest of that layer (attention: q projection, core, o projection; GDN: z / out projections and its
output path) and its MLP are neither run nor differentiated.
"""

from __future__ import annotations

from longstraw_mcore.parallel.cp import gdn_path, piece_bounds
from longstraw_mcore.planner.activations import chunk_map_elems
from longstraw_mcore.planner.flops import attn_pairs


def _mlp(m) -> int:
    return 3 * m.hidden_size * m.intermediate_size


class GatedAttentionFlops:
    @staticmethod
    def _weights(m, tp: int) -> tuple[int, int]:
        """(this rank's weights of the layer, of what the last layer's recompute leaves out)."""
        H, D, nq, nkv = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_key_value_heads
        attn = H * (2 * nq * D + 2 * nkv * D) + nq * D * H
        return (attn + _mlp(m)) // tp, (H * 2 * nq * D + nq * D * H + _mlp(m)) // tp

    @staticmethod
    def _unit(m, tp: int) -> float:
        return 2.0 * (m.num_attention_heads // tp) * m.head_dim

    def capture(self, m, tp, layer, chunks, kind, last=False, cp=1):
        W, pruned = self._weights(m, tp)
        Pc = sum(e - s for s, e in chunks)
        if last:  # only its K/V projections
            return 2.0 * (W - pruned) * Pc
        pairs = sum(attn_pairs(e - s, s, e, 0, m.attention_block, kind == "algorithm") for s, e in chunks)
        return 2.0 * W * Pc + self._unit(m, tp) * pairs * 2

    def replay(self, m, tp, layer, R, Pc, exact, store_probs, kind, path=(), seeded=False):
        W, _ = self._weights(m, tp)
        blocked = kind == "algorithm"
        q0 = Pc + sum(path)
        pp = attn_pairs(R, q0, Pc, 0, m.attention_block, blocked) if Pc else 0
        # a prefix tree's segments above: one key set each, their keys with gradients (leaves)
        seg, start = 0, Pc
        for n in path:
            seg += attn_pairs(R, q0, n, start, m.attention_block, blocked)
            start += n
        own = attn_pairs(R, q0, R, q0, m.attention_block, blocked)
        if blocked:
            prompt_bwd = (2 if store_probs else 3) + (2 if exact else 0)  # [recompute S,] dP, dQ (+ dK, dV)
            own_bwd = 5
        else:
            prompt_bwd, own_bwd = 2 + (2 if exact else 0), 4           # dP, dQ (+ dK, dV)
        u = self._unit(m, tp)
        return (3 * 2.0 * W * R + u * (pp + seg + own) * 2 + u * pp * prompt_bwd + u * seg * own_bwd
                + u * own * own_bwd)

    def recompute(self, m, tp, layer, s, e, last, kind, cp=1):
        W, pruned = self._weights(m, tp)
        T = e - s
        if last:  # only its K/V: their projections, forward and backward
            return 3 * 2.0 * (W - pruned) * T
        blocked = kind == "algorithm"
        pairs = attn_pairs(T, s, s, 0, m.attention_block, blocked) + attn_pairs(T, s, T, s, m.attention_block, blocked)
        return 3 * 2.0 * W * T + self._unit(m, tp) * pairs * (2 + (5 if blocked else 4))

    def forward(self, m, tp, layer, R, Pc):
        W, _ = self._weights(m, tp)
        pairs = (attn_pairs(R, Pc, Pc, 0, m.attention_block, False) if Pc else 0) + \
            attn_pairs(R, Pc, R, Pc, m.attention_block, False)
        return 2.0 * W * R + self._unit(m, tp) * pairs * 2

    def naive(self, m, tp, layer, T, kind):
        W, _ = self._weights(m, tp)
        blocked = kind == "algorithm"
        pairs = attn_pairs(T, 0, T, 0, m.attention_block, blocked)
        return 3 * 2.0 * W * T + self._unit(m, tp) * pairs * (2 + (5 if blocked else 4))


class GatedDeltaNetFlops:
    @staticmethod
    def _weights(m, tp: int) -> tuple[int, int]:
        """(this rank's weights of the layer, of what the last layer's recompute leaves out)."""
        H = m.hidden_size
        kd, vd = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
        gdn = H * (2 * kd + 2 * vd + 2 * m.linear_num_value_heads) + vd * H
        return (gdn + _mlp(m)) // tp, (2 * H * vd + _mlp(m)) // tp

    @staticmethod
    def _dims(m, tp: int):
        hv = m.linear_num_value_heads // tp
        ch = (2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim) // tp
        return hv, ch, m.gdn_chunk_size, m.linear_key_head_dim, m.linear_value_head_dim

    def _fwd(self, m, tp: int, tokens: int, wide: bool = False) -> float:
        """The rule and the conv over `tokens` in one run; `wide`: a sequence piece's run, on values K
        wider (module docstring)."""
        hv, ch, C, K, V = self._dims(m, tp)
        V = V + (K if wide else 0)
        sq = chunk_map_elems(tokens, C)  # sum over chunks of c^2 (the last chunk of its own length)
        return 2 * hv * (sq * (2 * K + V) + 3 * tokens * K * V) + 2 * ch * m.linear_conv_kernel_dim * tokens

    @staticmethod
    def _pieces(m, tp: int, cp: int) -> int:
        """The sequence pieces of a chunk under context parallelism by sequence (2 cp), else 0."""
        return 2 * cp if gdn_path(m, tp, cp) == "sequence" else 0

    def _scan(self, m, tp: int, tokens: int, pieces: int) -> float:
        """The sequence path's scan on every one of the pieces / 2 ranks and its outputs' correction."""
        hv, _, _, K, V = self._dims(m, tp)
        return pieces // 2 * pieces * 2 * hv * K * K * V + 2 * hv * K * V * tokens if pieces else 0.0

    def _bwd(self, m, tp: int, tokens: int, init_grad: bool, final_grad: bool, output_unused: bool = False,
             wide: bool = False) -> float:
        """Backward: both operands of every chunk matmul, plus the triangular solves' matmul
        gradients (dA = -dX X^T); minus the gradients nobody needs: the entering state's when it is a
        constant (`init_grad` False), the last chunk's state update when the final state is discarded
        (`final_grad` False), and the output path (Q K^T, (Q e^G) S, (Q K^T * D) U) when the layer's
        output feeds nothing (exact mode's last recomputed layer)."""
        hv, ch, C, K, V = self._dims(m, tp)
        V = V + (K if wide else 0)
        sq = chunk_map_elems(tokens, C)
        conv_fwd = 2 * ch * m.linear_conv_kernel_dim * tokens
        conv_bwd = conv_fwd * ch + conv_fwd  # FlopCounterMode: depthwise input-grad counted as dense
        solve = 2 * hv * sq * (V + K)
        first, last = min(C, tokens), (tokens % C or C)  # the first and last chunks' lengths
        state_mm = 2 * hv * K * V  # x c: one of W S, (Q e^G) S, (K e^{G_C-G})^T U for a chunk of c tokens
        unneeded = ((0 if init_grad else 2 * state_mm * first) + (0 if final_grad else 2 * state_mm * last)
                    if tokens else 0)
        full = 2 * (self._fwd(m, tp, tokens, wide) - conv_fwd) + conv_bwd + solve - unneeded
        if not output_unused:
            return full
        # output path: both operands of its three output matmuls in every chunk, less the entering-state
        # gradient of (Q e^G) S already left out above
        return full - (2 * (state_mm * tokens + 2 * hv * sq * (V + K))
                       - (0 if init_grad or not tokens else state_mm * first))

    def _linear(self, m, tp: int, layer: int, T: int, last: bool = False) -> float:
        """The layer's projections and MLP on T tokens, forward (`last`: only as far as its state)."""
        W, pruned = self._weights(m, tp)
        return 2.0 * (W - pruned if last else W) * T

    def capture(self, m, tp, layer, chunks, kind, last=False, cp=1):
        Pc = sum(e - s for s, e in chunks)
        n = self._pieces(m, tp, cp)
        rule = (sum(self._fwd(m, tp, b - a, True) for s, e in chunks for a, b in piece_bounds(e - s, n))
                + sum(self._scan(m, tp, e - s, n) for s, e in chunks) if n
                else sum(self._fwd(m, tp, e - s) for s, e in chunks))  # each capture chunk its own rule run
        return sum(self._linear(m, tp, layer, e - s, last) for s, e in chunks) + rule

    def replay(self, m, tp, layer, R, Pc, exact, store_probs, kind, path=(), seeded=False):
        # the state entering a branch is a constant (detached) or a leaf (exact, or a prefix tree's segment
        # above it); its final state is dropped, except a segment's (its children's gradient arrives there)
        init = (exact and Pc > 0) or bool(path)
        return 3 * self._linear(m, tp, layer, R) + self._fwd(m, tp, R) + self._bwd(m, tp, R, init_grad=init,
                                                                                 final_grad=seeded)

    def recompute(self, m, tp, layer, s, e, last, kind, cp=1):
        T = e - s
        lin = self._linear(m, tp, layer, T, last)
        n = self._pieces(m, tp, cp)
        if n:  # each piece's rule starts from a constant ([I | 0]); the scan and correction: forward + both
            # operands, except the gradient of the prompt's zero entering state (chunk 0: the first scan
            # step on every rank, the first piece's correction)
            hv, _, _, K, V = self._dims(m, tp)
            first = n // 2 * 2 * hv * K * K * V + 2 * hv * K * V * (piece_bounds(T, n)[0][1]) if s == 0 else 0
            return 3 * lin + 3 * self._scan(m, tp, T, n) - first + sum(
                self._fwd(m, tp, b - a, True) + self._bwd(m, tp, b - a, init_grad=False, final_grad=True,
                                                          output_unused=last, wide=True)
                for a, b in piece_bounds(T, n))
        return 3 * lin + self._fwd(m, tp, T) + self._bwd(m, tp, T, init_grad=s > 0, final_grad=True, output_unused=last)

    def forward(self, m, tp, layer, R, Pc):
        return self._linear(m, tp, layer, R) + self._fwd(m, tp, R)

    def naive(self, m, tp, layer, T, kind):
        return 3 * self._linear(m, tp, layer, T) + self._fwd(m, tp, T) + self._bwd(m, tp, T, False, False)
