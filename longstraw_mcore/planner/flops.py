"""Analytic FLOP counts of a GRPO group step: branch replay (both modes) and naive full-sequence GRPO.

Counts matrix-multiply FLOPs (2*M*N*K), the quantity `torch.utils.flop_counter.FlopCounterMode`
measures. Two counts per phase:
- `algorithm`: what this implementation does: attention over key blocks with query blocking (whole
  blocks where any key is visible), recompute of the scores in the attention backward
  (FlashAttention-2 style, which keeps memory O(queries x block); a branch that stores its
  probabilities over the prompt skips that recompute), log-prob chunks recomputed in
  backward (activation checkpointing), the chunked gated delta rule's matmuls, and the depthwise
  conv as FlopCounterMode counts it (its input gradient is counted like a dense conv).
- `minimum`: the same model math with nothing recomputed and only visible (query, key) pairs:
  forward once, backward = the gradients that are needed (constant prompt keys get none in
  detached mode).
- `model_3x`: the conventional count, forward once and backward = 2 x forward for every matmul.
Legend: P prompt length, R response length, G group size, C capture chunk, tp tensor parallel size.
"""

from __future__ import annotations

import math

from longstraw_mcore.config import ModelConfig


def _linear_weights(m: ModelConfig, tp: int) -> dict[str, int]:
    H, D = m.hidden_size, m.head_dim
    attn = H * (2 * m.num_attention_heads * D + 2 * m.num_key_value_heads * D) + m.num_attention_heads * D * H
    kd, vd = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    gdn = H * (2 * kd + 2 * vd + 2 * m.linear_num_value_heads) + vd * H
    mlp = 3 * H * m.intermediate_size
    return {"full_attention": (attn + mlp) // tp, "linear_attention": (gdn + mlp) // tp,
            "output": H * m.vocab_size // tp}


def _attn_pairs(T: int, q_start: int, S: int, k_start: int, block: int, blocked: bool) -> int:
    """(query, key) pairs computed for T queries at q_start against S keys at k_start (causal)."""
    if not blocked:  # visible pairs only: query at position q sees keys k_start..min(q, k_start+S-1)
        return sum(max(0, min(S, q_start + i - k_start + 1)) for i in range(T))
    total = 0
    for t0 in range(0, T, block):
        tq = min(block, T - t0)
        last_q = q_start + t0 + tq - 1
        for s0 in range(0, S, block):
            if k_start + s0 > last_q:
                break
            total += tq * min(block, S - s0)
    return total


class _Counter:
    def __init__(self, m: ModelConfig, tp: int):
        self.m, self.tp = m, tp
        self.w = _linear_weights(m, tp)
        self.hq, self.d = m.num_attention_heads // tp, m.head_dim
        self.n_attn = m.layer_types.count("full_attention")
        self.n_gdn = m.layer_types.count("linear_attention")
        self.hv = m.linear_num_value_heads // tp
        self.ch = (2 * m.linear_num_key_heads * m.linear_key_head_dim
                   + m.linear_num_value_heads * m.linear_value_head_dim) // tp

    def linear(self, tokens: int) -> float:
        w = self.n_attn * self.w["full_attention"] + self.n_gdn * self.w["linear_attention"]
        return 2.0 * w * tokens

    def gdn_fwd(self, tokens: int) -> float:
        m, C = self.m, self.m.gdn_chunk_size
        K, V = m.linear_key_head_dim, m.linear_value_head_dim
        n = math.ceil(tokens / C) if tokens else 0
        per_chunk = 2 * self.hv * (2 * C * C * K + C * C * V + 2 * C * K * V + C * K * V)
        conv = 2 * self.ch * m.linear_conv_kernel_dim * tokens
        return self.n_gdn * (n * per_chunk + conv)

    def gdn_bwd(self, tokens: int, init_grad: bool, final_grad: bool, output_unused: int = 0) -> float:
        """Backward: both operands of every chunk matmul, plus the triangular solves' matmul
        gradients (dA = -dX X^T); minus the gradients nobody needs: the entering state's when it is a
        constant (`init_grad` False), the last chunk's state update when the final state is discarded
        (`final_grad` False), and the output path (Q K^T, (Q e^G) S, (Q K^T * D) U) of the
        `output_unused` layers whose output feeds nothing (exact mode's last recomputed layer)."""
        m, C = self.m, self.m.gdn_chunk_size
        K, V = m.linear_key_head_dim, m.linear_value_head_dim
        n = math.ceil(tokens / C) if tokens else 0
        conv_fwd = 2 * self.ch * m.linear_conv_kernel_dim * tokens
        conv_bwd = conv_fwd * self.ch + conv_fwd  # FlopCounterMode: depthwise input-grad counted as dense
        solve = n * 2 * self.hv * (C * C * V + C * C * K)
        state_mm = 2 * self.hv * C * K * V  # one of W S, (Q e^G) S, (K e^{G_C-G})^T U for one chunk
        unneeded = (0 if init_grad else 2 * state_mm) + (0 if final_grad else 2 * state_mm) if n else 0
        full = 2 * (self.gdn_fwd(tokens) - self.n_gdn * conv_fwd) + self.n_gdn * (conv_bwd + solve - unneeded)
        # output path of one layer: both operands of its three output matmuls in every chunk, less the
        # entering-state gradient of (Q e^G) S already left out above
        out_path = n * 2 * (state_mm + 2 * self.hv * C * C * (V + K)) - (0 if init_grad or not n else state_mm)
        return full - output_unused * out_path

    def attn(self, pairs: int, units: int) -> float:
        return self.n_attn * 2.0 * self.hq * self.d * pairs * units


def step_flops(m: ModelConfig, P: int, lengths: list[int], mode: str, chunk_len: int, tp: int = 1,
               store_probs: bool = False) -> dict:
    """{"algorithm": {phase: flops}, "minimum": {phase: flops}} for one group step of branch replay.

    `store_probs`: the branches keep their attention probabilities over the prompt (no score
    recompute in their backward; `replay.attn_probs_budget_mib`)."""
    c = _Counter(m, tp)
    blk = m.attention_block
    Pc = P - 1
    chunks = [(s, min(Pc, s + chunk_len)) for s in range(0, Pc, chunk_len)]
    out = {"algorithm": {}, "minimum": {}}
    # capture: forward only, no output layer; each chunk's queries attend causally to the state buffer
    # up to the chunk's end in one call (key blocks counted from position 0)
    for kind, blocked in (("algorithm", True), ("minimum", False)):
        pairs = sum(_attn_pairs(e - s, s, e, 0, blk, blocked) for s, e in chunks)
        out[kind]["capture"] = c.linear(Pc) + c.attn(pairs, 2) + c.gdn_fwd(Pc)
    # branches: forward + backward, output layer on every branch token
    exact = mode == "exact"
    for kind, blocked in (("algorithm", True), ("minimum", False)):
        total = 0.0
        for R in lengths:
            pp = _attn_pairs(R, Pc, Pc, 0, blk, blocked) if Pc else 0
            own = _attn_pairs(R, Pc, R, Pc, blk, blocked)
            head = 2.0 * c.w["output"] * R
            fwd = c.linear(R) + c.attn(pp + own, 2) + c.gdn_fwd(R) + head
            if kind == "algorithm":
                prompt_bwd = (2 if store_probs else 3) + (2 if exact else 0)  # [recompute S,] dP, dQ (+ dK, dV)
                own_bwd = 5
                head_bwd = 3 * head                      # recompute (checkpoint) + dX + dW
            else:
                prompt_bwd = 2 + (2 if exact else 0)     # dP, dQ (+ dK, dV)
                own_bwd = 4
                head_bwd = 2 * head
            # the GDN state entering a branch is a constant (detached) or a leaf (exact); its final state is dropped
            gdn_bwd = c.gdn_bwd(R, init_grad=exact and Pc > 0, final_grad=False)
            bwd = 2 * c.linear(R) + c.attn(pp, prompt_bwd) + c.attn(own, own_bwd) + gdn_bwd + head_bwd
            total += fwd + bwd
        out[kind]["replay"] = total
    if exact:  # recompute each chunk with autograd, backward with every key needing a gradient
        # The recompute forward stops once the last layer has produced its state (forward_state), and
        # autograd back-propagates only into what a seeded state depends on: the rest of the last layer
        # (attention: q projection, attention core, o projection; GDN: z / out projections, its output
        # path) and its MLP are neither run nor differentiated.
        last = m.layer_types[-1]
        H, D = m.hidden_size, m.head_dim
        last_attn = last == "full_attention"
        if last_attn:
            pruned_w = (H * 2 * m.num_attention_heads * D + m.num_attention_heads * D * H + 3 * H * m.intermediate_size) // tp
        else:
            vd = m.linear_num_value_heads * m.linear_value_head_dim
            pruned_w = (2 * H * vd + 3 * H * m.intermediate_size) // tp
        attn_layers = c.n_attn - (1 if last_attn else 0)
        for kind, blocked in (("algorithm", True), ("minimum", False)):
            total = 0.0
            for s, e in chunks:
                T = e - s
                pp = _attn_pairs(T, s, s, 0, blk, blocked)
                own = _attn_pairs(T, s, T, s, blk, blocked)
                lin = c.linear(T) - 2.0 * pruned_w * T
                per_layer = 2.0 * c.hq * c.d * (pp + own)
                fwd = lin + attn_layers * per_layer * 2 + c.gdn_fwd(T)
                units = 5 if kind == "algorithm" else 4
                bwd = 2 * lin + attn_layers * per_layer * units \
                    + c.gdn_bwd(T, init_grad=s > 0, final_grad=True, output_unused=0 if last_attn else 1)
                total += fwd + bwd
            out[kind]["prompt_backward"] = total
    # The conventional model count: forward once, backward = 2 x forward for every matmul (attention
    # included, whether or not its keys need a gradient).
    conv = {"capture": out["minimum"]["capture"]}
    fwd_only = step_flops_forward(c, P, lengths, blk)
    conv["replay"] = 3 * fwd_only
    if exact:
        conv["prompt_backward"] = 3 * out["minimum"]["capture"]
    out["model_3x"] = conv
    for kind in out:
        out[kind]["total"] = sum(out[kind].values())
    return out


def step_flops_forward(c: "_Counter", P: int, lengths: list[int], blk: int) -> float:
    """Forward matmul FLOPs of all branches (visible pairs only), output layer included."""
    total = 0.0
    for R in lengths:
        pairs = (_attn_pairs(R, P - 1, P - 1, 0, blk, False) if P > 1 else 0) + _attn_pairs(R, P - 1, R, P - 1, blk, False)
        total += c.linear(R) + c.attn(pairs, 2) + c.gdn_fwd(R) + 2.0 * c.w["output"] * R
    return total


def naive_flops(m: ModelConfig, P: int, lengths: list[int], tp: int = 1) -> dict:
    """Plain full-sequence GRPO: every branch runs [prompt, y_b] forward and backward."""
    c = _Counter(m, tp)
    blk = m.attention_block
    out = {"algorithm": 0.0, "minimum": 0.0}
    for R in lengths:
        T = P + R - 1
        for kind, blocked in (("algorithm", True), ("minimum", False)):
            pairs = _attn_pairs(T, 0, T, 0, blk, blocked)
            head = 2.0 * c.w["output"] * R
            fwd = c.linear(T) + c.attn(pairs, 2) + c.gdn_fwd(T) + head
            units, head_bwd = (5, 3 * head) if kind == "algorithm" else (4, 2 * head)
            out[kind] += fwd + 2 * c.linear(T) + c.attn(pairs, units) + c.gdn_bwd(T, False, False) + head_bwd
    return out
