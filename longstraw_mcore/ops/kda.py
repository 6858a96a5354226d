"""Kimi Delta Attention (GLM-5.3-Flash's linear-attention mixer) in plain torch: chunked form + recurrent twin.

Legend: B batch, T tokens, H heads (as many key heads as value heads), K key dim, V value dim, C chunk length.
The gated delta rule of ops/gated_delta.py with a decay per key channel instead of one per head: per
head, with q L2-normalised and scaled by K^-0.5, k L2-normalised, decay g_t [K] <= 0, beta_t in (0, 1):

    S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t      (S: [K, V])

`chunk_kda` computes the same C tokens at a time. Inside a chunk, with cumulative decay G_i = sum_{j<=i} g_j
(a vector over K) and D_ij = exp(G_i - G_j) per channel (j <= i; every entry <= 1, so nothing overflows
whatever the gate's range, unlike a factored exp(G) exp(-G)):
    U = T (beta V) - T (beta K e^G) S_0           T = (I + A)^-1, A_ij = beta_i sum_c k_ic k_jc D_ijc, j < i
    O = (Q e^G) S_0 + P U                          P_ij = sum_c q_ic k_jc D_ijc, j <= i
    S_C = diag(e^{G_C}) S_0 + (K e^{G_C - G})^T U
The pairwise decay is a [C, C, K] tensor per chunk and head: this is the plain twin (tests, CPU runs at small
shapes), not a fast path. Both forms accept an initial state and return the final state (prompt capture and
branch replay). A sequence that is not a whole number of chunks ends with a chunk of its own length (no
padding). Everything runs in `state_dtype` (float32 under bf16/fp32 models, float64 under float64); inputs
are cast in, outputs cast back. `kda_gate` is the forget gate that makes g from the layer's projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw_mcore.ops.gated_delta import delta_recurrence, entering_state, l2norm, with_tail


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """g [B,T,H,K] (<= 0) from f = f_b(f_a(x)) [B,T,H*K], A_log [H], dt_bias [H*K], in float32 or wider:
    lower_bound * sigmoid(e^{A_log} (f + dt_bias)) with a lower bound (g in (lower_bound, 0)), else
    -e^{A_log} softplus(f + dt_bias) (unbounded below)."""
    dt = torch.promote_types(f.dtype, torch.float32)
    H = A_log.shape[0]
    x = (f.to(dt) + dt_bias.to(dt)).unflatten(-1, (H, -1))
    rate = A_log.to(dt).exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * torch.where(x > 20.0, x, F.softplus(x, threshold=1e9))


def _prepare(q, k, v, g, beta, state_dtype):
    """[B,T,H,K] q/k/g, [B,T,H,V] v, [B,T,H] beta -> [B,H,T,*] in state_dtype, q and k normalised."""
    if not (q.shape == k.shape == g.shape and v.shape[:3] == q.shape[:3] and beta.shape == q.shape[:3]):
        raise ValueError(f"KDA shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)} must be equal "
                         f"[B,T,H,K]; v {tuple(v.shape)} [B,T,H,V]; beta {tuple(beta.shape)} [B,T,H]")
    q, k, v, g, beta = (x.transpose(1, 2).to(state_dtype) for x in (q, k, v, g, beta))
    return l2norm(q) * (q.shape[-1] ** -0.5), l2norm(k), v, g, beta


def recurrent_kda(q, k, v, g, beta, initial_state=None, state_dtype=torch.float32):
    """Token-by-token reference. Returns (o [B,T,H,V] in v.dtype, final_state [B,H,K,V] in state_dtype)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state_dtype)
    B, H, T, Kd = k.shape
    Vd = v.shape[-1]
    S = entering_state(initial_state, B, H, Kd, Vd, state_dtype, v.device)
    o, S = delta_recurrence(q, k, v, g.exp()[..., None], beta, S)
    return o.to(out_dtype), S


def chunk_kda(q, k, v, g, beta, initial_state=None, chunk_size: int = 64, state_dtype=torch.float32):
    """Chunked KDA. Same contract as `recurrent_kda`; a sequence that is not a whole number of chunks ends
    with one chunk of its own length, continuing from the state the whole chunks leave."""
    return with_tail(_whole_chunks, q, k, v, g, beta, initial_state, chunk_size, state_dtype)


def _whole_chunks(q, k, v, g, beta, initial_state, C: int, state_dtype):
    """The chunked rule over a sequence of whole chunks of C tokens."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state_dtype)
    B, H, T, Kd = k.shape
    Vd = v.shape[-1]
    S = entering_state(initial_state, B, H, Kd, Vd, state_dtype, v.device)
    if T == 0:
        return v.new_zeros(B, 0, H, Vd).to(out_dtype), S
    n = T // C
    # chunk-major [n, B*H, C, *]
    q, k, v, g = (x.reshape(B * H, n, C, -1).transpose(0, 1) for x in (q, k, v, g))
    beta = beta.reshape(B * H, n, C).transpose(0, 1)
    G = g.cumsum(-2)                                                          # [n,BH,C,K]
    above = torch.ones(C, C, dtype=torch.bool, device=v.device).triu(1)
    # D_ijc = e^{G_ic - G_jc}, masked before exp (j > i would overflow and is never used)
    D = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(above[..., None], float("-inf")).exp()
    kb = k * beta[..., None]
    # A_ij = sum_c kb_ic D_ijc k_jc and P_ij = sum_c q_ic D_ijc k_jc as (elementwise [C, C, K]) then one batched
    # product each: 2 C^2 K multiply-adds per chunk and head, the planner's count (planner/flops_glm5_next.py)
    A = torch.einsum("nbijc,nbjc->nbij", kb[..., :, None, :] * D, k)
    # I + strict_lower(A): the unit-triangular solve reads neither A's diagonal nor its upper part
    rhs = torch.cat([v * beta[..., None], kb * G.exp()], dim=-1)
    U0, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([Vd, Kd], -1)
    P = torch.einsum("nbijc,nbjc->nbij", q[..., :, None, :] * D, k)          # j <= i (D is 0 above)
    q_dec = q * G.exp()
    k_dec = (k * (G[..., -1:, :] - G).exp()).transpose(-1, -2)              # [n,BH,K,C]
    chunk_decay = G[..., -1, :].exp()[..., None]                             # [n,BH,K,1]
    S = S.reshape(B * H, Kd, Vd)
    outs = []
    for i in range(n):
        u = U0[i] - W[i] @ S
        outs.append(q_dec[i] @ S + P[i] @ u)
        S = S * chunk_decay[i] + k_dec[i] @ u
    o = torch.stack(outs).reshape(n, B, H, C, Vd).permute(1, 0, 3, 2, 4).reshape(B, T, H, Vd)
    return o.to(out_dtype), S.reshape(B, H, Kd, Vd)
