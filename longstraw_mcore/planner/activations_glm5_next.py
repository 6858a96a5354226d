"""Bytes autograd keeps for the backward of T tokens through one GLM-5.3-Flash layer, per TP rank, as this code
computes it (planner/activations.py's conventions and legend: e the model dtype's bytes, s the state dtype's, w
the wider of e and float32). Derived tensor by tensor from what the forward saves and checked against
`saved_tensors_hooks` counts (tests/unit/test_planner_activations.py, within 10%).

    hyper-connections  per sublayer and token: the streams it reads N H e (their weights are recomputed in the
                       backward: models/hyper_connection.py), pre N w, post N e, comb N^2 e and the
                       sublayer's output H e (the mix); the sublayer's RMSNorm
    KDA                the projections' inputs (x, the two low-rank halves' K, the output projection's D); the
                       conv's window, weight and output, its silu'd output (q, k, v: their float copies below
                       float32) and q/k's 1/norm; the gate's two [K] per head; the chunked rule (ops/kda.py) per
                       chunk and head 3 [C, C, K] pairwise-decay products and 2 [C, C] maps, per token and head
                       13 [K] + 2 [V], per chunk the entering state; the sigmoid-gated norm's 4 [K] + 1 per head
    MLA + DSA          GLM-5.2's terms (planner/activations.py mla_bytes) with no RoPE and the pooled
                       selection's width (min(index_topk / kpool, pools) kpool + kpool - 1 slots per query)
    MLP                SwiGLU with the clamp (the clamped gate and up are new tensors): input H, fc1's output
                       2F, the clamped gate, its silu, the clamped up, the product F each; MoE as GLM-5.2's
"""

from __future__ import annotations

from longstraw_mcore.planner.activations import _elem, chunk_map_elems, mla_bytes, moe_bytes, rms_norm_bytes


def hc_bytes(m, T: int) -> int:
    """One hyper-connected sublayer's streams, weights and mix, and its RMSNorm, for T tokens."""
    e, w, N, H = _elem(m.dtype), max(4, _elem(m.dtype)), m.hc_mult, m.hidden_size
    return T * (N * H * e + N * w + N * e + N * N * e + H * e) + T * rms_norm_bytes(H, e)


def clamped_mlp_bytes(hidden: int, ffn_local: int, e: int) -> int:
    """Per token, SwiGLU with the clamp (models/glm5_next.py `activation_func_clamp_value`)."""
    return hidden * e + 6 * ffn_local * e


def kda_bytes(m, tp: int, T: int, keys: int = 0, wide: bool = False) -> int:
    """T tokens through one KDA mixer (ops/kda.py's chunks, the last one of its own length). `wide`: a chunk's
    pieces under context parallelism by sequence: the rule's value-sized terms at K + V."""
    e, s = _elem(m.dtype), max(4, _elem(m.dtype))
    h, K, C, W, Hd = m.linear_num_heads // tp, m.linear_head_dim, m.gdn_chunk_size, m.linear_conv_kernel_dim, \
        m.hidden_size
    V = K + (K if wide else 0)
    ch, n = 3 * h * K, -(-T // C)
    b = T * (Hd + 2 * K + h * K) * e                                        # projections' inputs
    b += ch * (T + W - 1) * e + ch * W * e + T * ch * e                     # conv window, weight, output
    b += T * ch * e if e == s else 3 * T * h * K * s                        # silu'd q, k, v (float copies)
    b += 2 * T * h * s                                                      # q, k 1/norm
    b += 2 * T * h * K * s + h * s                                          # the gate
    b += h * (3 * chunk_map_elems(T, C) * K + 2 * chunk_map_elems(T, C)) * s   # pairwise decays, A, P
    b += T * h * (13 * K + 2 * V + 1) * s + n * h * (K * V + K) * s         # per token; per chunk: S, decay
    b += T * h * K * s if wide else 0                                       # the piece's output map
    b += T * h * (4 * K + 1) * s                                            # sigmoid-gated norm
    return b


def _mlp(m, tp: int, T: int, layer: int) -> int:
    e = _elem(m.dtype)
    if m.mlp_types[layer] == "moe":
        return moe_bytes(m, -(-T // tp))
    return T * clamped_mlp_bytes(m.hidden_size, m.intermediate_size // tp, e)


def kda_layer_bytes(m, tp: int, T: int, layer: int, keys: int = 0, produce_only: bool = False,
                    query_block: int = 0, gdn_wide: bool = False) -> int:
    """A KDA layer: two hyper-connected sublayers (`produce_only`: the attention's, without its mix, and the
    mixer: exact mode's recompute of the model's last layer, an upper bound)."""
    mix = kda_bytes(m, tp, T, keys, gdn_wide)
    if produce_only:
        return mix + hc_bytes(m, T)
    return mix + _mlp(m, tp, T, layer) + 2 * hc_bytes(m, T)


def _pooled_width(m, keys: int) -> int:
    kp = m.index_kpool
    return min(m.index_topk // kp, keys // kp) * kp + kp - 1


def mla_kpool_layer_bytes(m, tp: int, T: int, layer: int, keys: int = 0, produce_only: bool = False,
                          query_block: int = 0, kernel: str = "plain", gdn_wide: bool = False) -> int:
    """An MLA + DSA layer with the pooled indexer: GLM-5.2's mixer terms at the pooled selection's width, two
    hyper-connected sublayers (`gdn_wide` is the KDA layers' context-parallel flag: no term here)."""
    keys = max(keys, T)
    mix = mla_bytes(m, tp, T, keys, query_block, kernel, k=_pooled_width(m, keys))
    if produce_only:
        return mix + hc_bytes(m, T)
    return mix + _mlp(m, tp, T, layer) + 2 * hc_bytes(m, T)
