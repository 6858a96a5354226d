"""Bytes autograd keeps for the backward of T tokens through one layer, as this code computes it (the
plain-torch twins: ops/gated_delta.py, ops/attention.py, the Megatron projections), per TP rank.
Each family's layer records (prompt_state/kinds.py, families/) name their composition: Qwen's
`hybrid_layer_bytes` over its mixer's term, GLM's `glm_layer_bytes`; `layer_bytes` reads the record.

Derived tensor by tensor from what the forward saves (checked against `saved_tensors_hooks` counts
in tests/unit/test_planner_activations.py), so the terms follow the code: when an op changes, its
formula here changes with it. Legend: e the model dtype's bytes, s the state dtype's (float32 for
bf16/fp32 models, float64 for float64), Hd hidden, local heads (/tp) throughout.

    norm (RMSNorm)   input, float32 copy below float32, normalised output, 1/rms
    MLP (SwiGLU)     fc1 input, fc1 output (2F), the gated product's two inputs and its output
    Gated DeltaNet   x; the conv window [Ch, T+W-1] and its output; q, k (repeated to the value
                     heads) in s with their norms; the chunked rule's per-chunk matrices: 5 of
                     [C, C], 6 of [C, Dk] (q, k, k*beta, W, the decayed k and q), 2 of [C, Dv] (v,
                     U0) and 3 of [C] per value head and chunk, and per chunk the state entering it
                     and u; the gated norm's three s and three e [Dv] tensors
    gated attention  x; k and q norms (two s copies each); RoPE angles; q, own k/v and the output
                     kept by the merge Function (the prompt K/V it reads are the state, counted
                     there); the gate's input and output and the output projection's input
    MLA + DSA        x; the latent and q-LoRA norms; RoPE angles; q; the selected rows' indices;
                     the visible latents and RoPE keys gathered into one tensor (prompt + own: a
                     full-size copy per layer, see prompt_state/mla.py); per query the k selected
                     latents and RoPE keys; q in latent space, the rotated q, the validity mask, the
                     softmax in s and its cast, the latent-space output, the output projection's input
                     (the indexer runs without autograd). memory.mla_query_block = B > 0: the
                     per-query top-k terms (indices, selected latents, mask, softmax) for min(T, B)
                     queries only (one block at a time, recomputed in its backward: ops/dsa.py).
                     ops.dsa's kernels (ops/dsa_triton_mla.py) instead: no selected latents, softmax
                     or mask of [k]; their output o_lat and its float32 lse (`mla_bytes` kernel)
    MoE (GLM)        the shared experts as a SwiGLU each; the router's logits, scores and top-k; the
                     permuted tokens (top-k copies) and each expert's SwiGLU on its tokens
"""

from __future__ import annotations


def _elem(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def zero_centred_norm_bytes(hidden: int, e: int) -> int:
    """Per token: Qwen's zero-centred RMSNorm keeps its input, a float32 copy below float32 and the output."""
    return hidden * (2 * e + (4 if e < 4 else 0)) + 4


def rms_norm_bytes(hidden: int, e: int) -> int:
    """Per token: GLM's RMSNorm keeps the float32 copy (the input itself at float32 and above) and the output."""
    w = max(4, e)
    return hidden * (w + e) + w


def mlp_bytes(hidden: int, ffn_local: int, e: int) -> int:
    """Per token, SwiGLU with fc1 = [gate | up] (column parallel) and fc2 row parallel."""
    return hidden * e + 5 * ffn_local * e


def chunk_map_elems(T: int, C: int) -> int:
    """Elements of one [c, c] map per chunk over T tokens in GDN chunks of C: whole chunks, then a last
    chunk of its own length (ops/gated_delta.py pads nothing)."""
    return (T // C) * C * C + (T % C) ** 2


def gdn_bytes(m, tp: int, T: int, keys: int = 0, wide: bool = False) -> int:
    """T tokens (in GDN chunks, the last one of its own length) through one Gated DeltaNet mixer. `wide`: a
    chunk's pieces under context parallelism by sequence (parallel/cp_gdn.py): the rule's value-sized
    terms at Dk + Dv (values [0 | v] from the state [I | 0]), and its maps' corrections' input c [T, Hv, Dk]."""
    e, s = _elem(m.dtype), max(4, _elem(m.dtype))
    hk, hv = m.linear_num_key_heads // tp, m.linear_num_value_heads // tp
    dk, dv, C, W = m.linear_key_head_dim, m.linear_value_head_dim, m.gdn_chunk_size, m.linear_conv_kernel_dim
    Hd = m.hidden_size
    ch = 2 * hk * dk + hv * dv
    n = -(-T // C)
    b = T * Hd * e + ch * (T + W - 1) * e + ch * W * e + T * ch * e      # x, conv window, conv weight, conv out
    b += 3 * T * hv * s + 2 * T * hv * (dk + 1) * s                      # gates; q, k in s with 1/norm
    rv = dv + (dk if wide else 0)                                        # the rule's value width
    b += hv * (5 * chunk_map_elems(T, C) + T * (6 * dk + 2 * rv + 3) + n) * s  # the chunked rule's matrices
    b += hv * rv * (n * dk + T) * s                                      # per chunk: state in, u
    b += T * hv * dk * s if wide else 0                                  # c: the piece's output map
    b += T * hv * (3 * dv + 1) * s + 3 * T * hv * dv * e                 # gated norm, output projection input
    return b


def attention_bytes(m, tp: int, T: int, keys: int = 0, wide: bool = False) -> int:
    """T tokens through one gated-attention mixer (replay: the prompt's K/V are the state); `wide` is
    Gated DeltaNet's (hybrid_layer_bytes hands it to either mixer)."""
    e, s = _elem(m.dtype), max(4, _elem(m.dtype))
    hq, hkv = m.num_attention_heads // tp, max(1, m.num_key_value_heads // tp)
    d, Hd = m.head_dim, m.hidden_size
    b = T * Hd * e                                                       # x (q/k/v projections' input)
    b += 2 * T * hkv * d * s + T * hkv * s + 2 * T * hq * d * s + T * hq * s   # k and q norms
    b += 2 * T * m.rotary_dim * e                                        # RoPE cos, sin
    b += 2 * T * hq * d * e + 2 * T * hkv * d * e + T * hq * s           # merge Function: q, out, own k/v, lse
    b += 3 * T * hq * d * e                                              # gate in/out, projection input
    return b


def mla_bytes(m, tp: int, T: int, keys: int, query_block: int = 0, kernel: str = "plain", k: int | None = None) -> int:
    """T tokens through one MLA + DSA mixer that sees `keys` latents (this rank's prompt rows + its own).
    `query_block` B > 0 (memory.mla_query_block): the queries run in blocks of B, each recomputed in its
    backward, so the terms that scale with top-k (indices, selected latents, mask, softmax) are kept
    for Tq = min(T, B) queries only. `kernel` (ops.dsa's, ops/kernel_choice.py dsa_kernel_name):
    "triton", the sparse MLA kernel (ops/dsa_triton_mla.py), gathers the selected latents inside the
    kernel and keeps no logits or probabilities: it saves q in latent space, the rotated q, the indices
    and an int8 validity copy (the visible latents are the prompt state's rows and the call's own, read
    where they lie, not joined), its output o_lat [T, h, R] (e) and lse [T, h]
    (float32), for every query (the query blocks are the twin's; the kernel takes none). `k`: the selection's
    width where it is not min(index_topk, keys) (GLM-5.3-Flash's pooled indexer)."""
    e, w = _elem(m.dtype), max(4, _elem(m.dtype))
    h, R, Dr, Dn, Dv, ql = (m.num_attention_heads // tp, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim,
                            m.v_head_dim, m.q_lora_rank)
    k = min(m.index_topk, keys) if k is None else k
    Tq = min(T, query_block) if query_block > 0 and kernel == "plain" else T
    b = T * m.hidden_size * e + T * (R * (w + e) + w) + T * (ql * (w + e) + w) + T * ql * e   # x, norms, q_b input
    b += 2 * T * Dr * e + T * h * (Dn + Dr) * e + Tq * k * 8                                 # RoPE, q, indices
    if kernel != "triton":  # the twin's visible latents, the state's rows and the call's joined (ops/dsa.py
        b += keys * (R + Dr) * e  # joined_rows); the kernel reads the two parts where they lie
    b += 2 * T * h * R * e + T * h * Dr * e + Tq * k + T * h * Dv * e   # q latent, o_lat, rotated q, mask, o_proj input
    if kernel == "triton":
        return b + T * h * 4                                                                 # lse
    return b + Tq * k * (R + Dr) * e + Tq * h * k * (w + e)            # selected latents; softmax and its cast


def mla_backward_scratch(m, T: int, keys: int, tp: int = 1, kernel: str = "plain") -> int:
    """What an MLA + DSA layer's backward makes beside its saved tensors for T queries whose `keys` latent
    rows take a gradient. "triton" (ops/dsa_triton_mla.py _SparsePartial.backward): the gradient of o_lat
    arriving [T, h, R], dq in latent space and of the rotated q (e), and float32 gradient buffers of the
    latents and RoPE keys that take one, [keys, R], [keys, Dr] (the kernel reads the prompt state and a
    call's own rows as two parts: a replayed branch's own rows, plus the state's in exact mode; a sweep
    chunk's rows and the leaves before it), cast to e below float32. "plain": 0 here; the planner counts the
    twin's backward as one layer's saved tensors' worth (planner/memory.py phase_bytes)."""
    if kernel == "plain":
        return 0
    e = _elem(m.dtype)
    h, R, Dr = m.num_attention_heads // tp, m.kv_lora_rank, m.qk_rope_head_dim
    return T * h * (2 * R + Dr) * e + keys * (R + Dr) * (4 + (e if e != 4 else 0))


RNG_STATE_BYTES = 5056
"""torch.get_rng_state(): the CPU generator's state, which every torch.utils.checkpoint call keeps
(preserve_rng_state) as long as its graph lives: memory.recompute=layer's per layer and the twin's MLA
query blocks (memory.mla_query_block, ops/dsa.py by_query_blocks) per block. A CPU tensor: device
bytes on a CPU run only (on CUDA it, and the device's generator state, are in host memory)."""


def mla_checkpoints(m, T: int, query_block: int = 0, kernel: str = "plain") -> int:
    """torch.utils.checkpoint calls one MLA layer's forward makes under autograd: one per query block of
    the twin (none for one block, or for the kernel, which takes no blocks)."""
    return -(-T // query_block) if kernel == "plain" and 0 < query_block < T else 0


def attention_score_blocks(m, T: int, keys: int, tp: int = 1) -> int:
    """Attention's block of scores for one (query block, key block) pair (ops/block_attention.py): the
    masked scores, the shifted scores and their exp, alive together at the exp, each [local heads,
    min(T, block), min(keys, block)] in >= float32. Made in a capture chunk's forward (no autograd) and
    again in the backward of a layer, which recomputes its probabilities from the log-sum-exp."""
    w = max(4, _elem(m.dtype))
    b = m.attention_block
    return 3 * (m.num_attention_heads // tp) * min(T, b) * min(keys, b) * w


def attention_scratch_bytes(m, T: int, keys: int, tp: int = 1) -> int:
    """A gated-attention layer's capture peak for a chunk of T queries over `keys` (no autograd), at the
    exp of its largest score block: the blocks (`attention_score_blocks`), the block's causal mask
    (bool), and what is alive beside them: the layer's input, its residual and normed input [T, hidden]
    x e, the q|gate projection's output, the rotated q, its scaled work-dtype copy, the merged output
    and the block's accumulator, the own keys' projection and rotated copy (the K/V written into the
    state are the state's bytes). Counted tensor by tensor from the live storages at that moment: at a
    299-token chunk of the tiny config 4.92 MiB planned against 4.94 measured, at 1,199 tokens 51.98
    against 52.00."""
    e, w, b = _elem(m.dtype), max(4, _elem(m.dtype)), m.attention_block
    hq, hkv, d = m.num_attention_heads // tp, max(1, m.num_key_value_heads // tp), m.head_dim
    live = min(T, b) * min(keys, b)                                        # the block's mask
    live += T * (3 * m.hidden_size * e + 2 * hq * d * e + hq * d * e)      # input, residual, normed; q|gate, q
    live += T * hq * d * 2 * w + hq * min(T, b) * d * w                    # q's work copy, output; accumulator
    live += 2 * T * hkv * d * e                                            # own keys: projection and rotated
    return attention_score_blocks(m, T, keys, tp) + live


def _op_bytes(m, attention: str) -> int:
    """Bytes per element the flash op computes in: the work dtype on CPU ("flash_cpu": bf16 / fp16
    inputs run in float32), the model dtype on CUDA ("flash")."""
    return max(4, _elem(m.dtype)) if attention == "flash_cpu" else _elem(m.dtype)


def attention_backward_scratch(m, T: int, keys: int, tp: int = 1, attention: str = "plain") -> int:
    """What a gated-attention layer's backward makes beside its saved tensors for T queries over `keys`.
    plain: its score blocks, recomputed from the log-sum-exp (`attention_score_blocks`). flash /
    flash_cpu (ops/flash_attention.py partial_backward; o the op's bytes, `_op_bytes`): the row norms
    and O' (`o_eff`) in the work dtype, dO and O' in the op's layout, the op's dQ and its work copy,
    and the op's dK / dV over every visible key (made even where the keys need no gradient, the prompt
    state in detached mode; the keys' work-dtype gradients are the state gradient, counted apart).
    Measured on CPU (models of one layer kind, R = 64-256): within 0.17 MiB of what the backward adds
    (the op's per-thread blocks, 2 [q split, kv split] float32 a thread, are not counted); the CUDA
    side is derived from the same code."""
    if attention == "plain":
        return attention_score_blocks(m, T, keys, tp)
    w, o = max(4, _elem(m.dtype)), _op_bytes(m, attention)
    hq, hkv, d = m.num_attention_heads // tp, max(1, m.num_key_value_heads // tp), m.head_dim
    return T * hq * (2 * w + d * w + 2 * d * o + d * o + d * w) + 2 * keys * hkv * d * o


def attention_capture_bytes(m, T: int, keys: int, tp: int = 1, attention: str = "plain") -> int:
    """A gated-attention layer's capture peak for a chunk of T queries over `keys` (no autograd): the
    larger of its attention's moment and its MLP's (`mlp_moment_bytes`). plain: the exp of its largest
    score block (`attention_scratch_bytes`). flash / flash_cpu: the layer's input, residual and normed
    input, the q|gate projection and the rotated q, the own keys' projection and rotated copy, RoPE's
    angles; the merge's output and the op's merged copy (work dtype) and the op's output (its dtype),
    and on CPU below float32 the op's float32 copies of q and of the visible K/V (the op's per-thread
    blocks, a few hundred KiB a thread, are not counted). At 1,199 tokens of the tiny config on CPU:
    2.96 MiB planned against 2.98 measured in float32, 2.51 against 2.62 in bfloat16."""
    if attention == "plain":
        mix = attention_scratch_bytes(m, T, keys, tp)
    else:
        e, w, o = _elem(m.dtype), max(4, _elem(m.dtype)), _op_bytes(m, attention)
        hq, hkv, d = m.num_attention_heads // tp, max(1, m.num_key_value_heads // tp), m.head_dim
        mix = T * (3 * m.hidden_size * e + 3 * hq * d * e + 2 * hkv * d * e + 2 * m.rotary_dim * e)
        mix += T * hq * d * (2 * w + o) + ((T * hq * d + 2 * keys * hkv * d) * o if o != e else 0)
    return max(mix, mlp_moment_bytes(m, T, tp))


def mlp_moment_bytes(m, T: int, tp: int = 1) -> int:
    """A Qwen layer's capture moment in its SwiGLU MLP (no autograd), at the gated product: the layer's
    input, residual and normed input [T, Hd], fc1's output [T, 2F], and three [T, F] (silu of the
    gate, the product and its operand). At 1,199 tokens of the tiny config: 3.805 MiB, as measured."""
    return T * (3 * m.hidden_size + 5 * (m.intermediate_size // tp)) * _elem(m.dtype)


def gdn_capture_bytes(m, T: int, keys: int = 0, tp: int = 1, attention: str = "plain") -> int:
    """A Gated DeltaNet layer's capture peak for a chunk of T tokens (no autograd), at the end of the
    chunked rule (ops/gated_delta.py), where its outputs are copied to token-major order while every
    map it made is alive; or, where larger, its MLP's moment. Alive then: the layer's input and normed
    input [T, Hd]; the q, k, v, b, a projections; the conv's input with its window [Ch, T+W-1] (the
    state's window is cut from it) and its silu'd output [T, Ch]; beta and g, their chunk-major copies
    and G; per value head 3 [C, C] maps per chunk, the last chunk's of its own length (the decays,
    made in place from the gate differences; A, which the unit-triangular solve reads as it is; the
    intra-chunk scores), 6 of [Dk] (q, k, k*beta, W, the decayed k and q) and 4 of [Dv] (v, U0, the
    outputs and their token-major copy), all in s; below s the output's cast. plan_vs_measured's
    detached recompute points at P=1200 (chunk 16), whose peak this moment sets, read 1.047-1.052
    planned / measured on 77e4d45 (with the 5 maps the rule made before it, 1.13-1.15 against its
    code; on the padded rule, 6.87 MiB planned against 6.88 measured for this layer alone at 1,199
    tokens). `attention` is the attention layers' kernel (no term here). Under context parallelism
    by sequence the planner takes the layer's upper bound instead (gdn_bytes `wide`)."""
    e, s = _elem(m.dtype), max(4, _elem(m.dtype))
    hk, hv = m.linear_num_key_heads // tp, m.linear_num_value_heads // tp
    dk, dv, C, W = m.linear_key_head_dim, m.linear_value_head_dim, m.gdn_chunk_size, m.linear_conv_kernel_dim
    ch = 2 * hk * dk + hv * dv
    b = 2 * T * m.hidden_size * e                                         # input, normed input
    b += T * (2 * hk * dk + hv * dv + 2 * hv) * e                         # q, k, v, b, a projections
    b += ch * (T + W - 1) * e + T * ch * e                                # conv input with window; silu output
    b += 5 * T * hv * s                                                   # beta, g; their copies, G
    b += hv * (3 * chunk_map_elems(T, C) + T * (6 * dk + 4 * dv)) * s   # the rule's maps
    b += T * hv * dv * e if e != s else 0                                 # the output's cast
    return max(b, mlp_moment_bytes(m, T, tp))


GDN_BACKWARD_MAPS = 5
"""[C, C] maps per chunk and value head that a Gated DeltaNet layer's backward makes beside its saved
tensors. Fitted to measurement, not derived from the code: 3.1 in a float32 replay, 4.7 in bfloat16,
5.7 in the exact sweep under recompute (models of one layer kind, the profiler's live storages)."""


def gdn_backward_scratch(m, T: int, keys: int = 0, tp: int = 1, attention: str = "plain") -> int:
    """What a Gated DeltaNet layer's backward makes beside its saved tensors for T tokens:
    GDN_BACKWARD_MAPS maps of [C, C] per chunk and value head in s (the gradients of the rule's
    maps, made while the maps they consume are still saved), and the chunk loop's backward
    (ops/gated_delta._StateLoop: all chunks at once) its du [T, Dv] and the gradients of W and of the
    decayed keys [T, Dk] each, per value head in s."""
    s, C = max(4, _elem(m.dtype)), m.gdn_chunk_size
    hv = m.linear_num_value_heads // tp
    loop = hv * T * (m.linear_value_head_dim + 2 * m.linear_key_head_dim) * s
    return GDN_BACKWARD_MAPS * hv * chunk_map_elems(T, C) * s + loop


def index_bytes(m, T: int, keys: int, tp: int = 1, kernel: str = "plain") -> int:
    """A full DSA layer's capture peak for T queries over `keys` (no autograd), in its indexer: one key
    block at a time with the running best k, the per-head scores and their ReLU over a block plus the
    best k and their weighted sum; beside them the layer's input, residual and normed input [T, hidden]
    x e, the fused down-projection's output (q latent, KV latent, RoPE key, index key) and the normed q
    latent, the indexer's queries, the RoPE part of q, and the running best indices (int64). At a
    199-token chunk of the tiny config 1.61 MiB planned against 1.53 measured. `kernel` "triton" (ops.dsa's,
    ops/dsa_triton_indexer.py): the same selection over the same key blocks, without the per-head scores
    and their ReLU (the kernel sums the heads in registers): one float32 score per query and key."""
    e, w = _elem(m.dtype), max(4, _elem(m.dtype))
    k = min(m.index_topk, keys)
    kb = min(m.index_block, keys) + k
    ql, R, Dr, dI = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.index_head_dim
    live = T * (3 * m.hidden_size * e + (2 * ql + R + Dr + dI) * e + m.index_n_heads * dI * e
                + (m.num_attention_heads // tp) * Dr * e)
    per_key = 1 if kernel == "triton" else 2 * m.index_n_heads + 1
    return T * kb * per_key * w + live + T * 2 * k * 8


def moe_bytes(m, T: int) -> int:
    """T tokens (this rank's) through one MoE block: shared experts, router, top-k routed experts."""
    e, Hd, F, k = _elem(m.dtype), m.hidden_size, m.moe_intermediate_size, m.num_experts_per_tok
    b = T * Hd * e + m.n_shared_experts * T * 5 * F * e                                     # input, shared
    b += T * m.n_routed_experts * 4 + T * k * 36 + T * 4                                    # router
    b += T * k * (Hd * e + 5 * F * e + 4)                                                   # routed experts
    return b


def hybrid_layer_bytes(mixer_bytes, m, tp: int, T: int, layer: int, keys: int = 0, produce_only: bool = False,
                       query_block: int = 0, gdn_wide: bool = False) -> int:
    """A Qwen layer: its mixer (`mixer_bytes`: gdn_bytes or attention_bytes), the SwiGLU MLP, two
    zero-centred norms; `produce_only`: input norm and mixer (see `layer_bytes`). `query_block` is MLA's
    (no term here); `gdn_wide`: gdn_bytes' `wide`."""
    e = _elem(m.dtype)
    mix, norm = mixer_bytes(m, tp, T, keys, gdn_wide), T * zero_centred_norm_bytes(m.hidden_size, e)
    if produce_only:
        return mix + norm
    return mix + T * mlp_bytes(m.hidden_size, m.intermediate_size // tp, e) + 2 * norm


def glm_layer_bytes(m, tp: int, T: int, layer: int, keys: int = 0, produce_only: bool = False,
                    query_block: int = 0, kernel: str = "plain") -> int:
    """A GLM layer: MLA + DSA over `keys` latents (queries in blocks of `query_block`, ops.dsa's `kernel`:
    see `mla_bytes`), the dense SwiGLU or the MoE block (its tokens split by sequence over TP), two
    RMSNorms; `produce_only`: input norm and mixer (see `layer_bytes`)."""
    e = _elem(m.dtype)
    mix, norm = mla_bytes(m, tp, T, max(keys, T), query_block, kernel), T * rms_norm_bytes(m.hidden_size, e)
    if produce_only:
        return mix + norm
    if m.mlp_types[layer] == "moe":
        mlp = moe_bytes(m, -(-T // tp))  # the MoE layer splits its tokens by sequence over TP
    else:
        mlp = T * mlp_bytes(m.hidden_size, m.intermediate_size // tp, e)
    return mix + mlp + 2 * norm


def layer_bytes(layers: dict, m, tp: int, T: int, layer: int, keys: int = 0, produce_only: bool = False,
                query_block: int = 0) -> int:
    """T tokens through layer `layer` (global index), by its family's record (`layers`: {layer type:
    LayerKind}): mixer, MLP, both norms. `keys`: the latents an MLA layer sees (this rank's prompt rows +
    T). `produce_only`: the layer runs only as far as its state (exact mode's recompute of the model's
    last layer): its input norm and mixer, an upper bound. `query_block` (memory.mla_query_block, > 0)
    is handed to the record only when set, so a record without the keyword keeps working."""
    return kind_bytes(layers[m.layer_types[layer]], m, tp, T, layer, keys, produce_only, query_block)


def kind_bytes(kind, m, tp: int, T: int, layer: int, keys: int = 0, produce_only: bool = False,
               query_block: int = 0, gdn_wide: bool = False, kernel: str = "plain") -> int:
    """`layer_bytes` for a layer whose record (`kind`) the caller already holds. `gdn_wide`: a prompt
    chunk's Gated DeltaNet by sequence pieces (context parallelism, parallel/cp_gdn.py: values Dk wider
    in its rule), handed on only when set, like `query_block`; `kernel`: the kernel of a kind that names
    its own (LayerKind.kernel_name: GLM's ops.dsa), handed on where it is not the twin ("plain")."""
    kw = {"query_block": query_block} if query_block > 0 else {}
    if gdn_wide:
        kw["gdn_wide"] = True
    if kernel != "plain" and kind.kernel_name is not None:
        kw["kernel"] = kernel
    return kind.activation_bytes(m, tp, T, layer, keys, produce_only, **kw)


def kept_graph_bytes(cfg, P: int, saved_for, layers, lt, stage: range) -> int:
    """Exact mode's capture graphs kept for the sweep (replay.keep_prompt_graph_mib): the last chunks
    whose saved tensors (`saved_for(tokens)`) fit the budget together, where the kept capture applies
    (replay/steps.py kept_chunks: one stage, no context parallelism, KV groups or staged state, attention
    and Gated DeltaNet layers only); 0 elsewhere."""
    rc, p, m, mem = cfg.replay, cfg.parallel, cfg.model, cfg.memory
    budget = rc.keep_prompt_graph_mib * 2**20
    if (rc.mode != "exact" or budget <= 0 or p.pp > 1 or p.cp > 1 or p.tp > getattr(m, "num_key_value_heads", p.tp)
            or mem.state_offload or mem.state_dtype == "fp8"
            or (cfg.adapter.enabled and cfg.adapter.prompt == "frozen")
            or any(layers[lt[i]].state.kind not in ("attention_kv", "gdn_state") for i in stage)):
        return 0
    total = 0
    for s0 in reversed(range(0, max(P - 1, 0), rc.chunk_len)):
        need = saved_for(min(P - 1, s0 + rc.chunk_len) - s0)
        if total + need > budget:
            break
        total += need
    return total

