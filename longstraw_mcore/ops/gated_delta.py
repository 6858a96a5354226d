"""Gated delta rule (Gated DeltaNet's token mixer) in plain torch: chunked form + recurrent twin.

Legend: B batch, T tokens, H value heads, K key dim, V value dim, C chunk length.
Per head, with q L2-normalised and scaled by K^-0.5, k L2-normalised, decay g_t <= 0, beta_t in (0,1):

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t      (S: [K, V])

`chunk_gated_delta_rule` computes the same thing C tokens at a time (WY / UT form): inside a chunk,
with cumulative decay G_i = sum_{j<=i} g_j,
    U = T (beta V) - T (beta exp(G) K) S_0            T = (I + A)^-1, A_ij = beta_i e^{G_i-G_j} k_i.k_j, j < i
    O = (Q e^G) S_0 + (Q K^T * D) U                   D_ij = e^{G_i-G_j}, j <= i
    S_C = e^{G_C} S_0 + (K e^{G_C - G})^T U
Both accept an initial state and return the final state: this is the hook prompt capture and branch
replay use. Zero padding at the end of the sequence (k = v = 0, beta = 0, g = 0) leaves the state
unchanged, so any T works. Everything runs in `state_dtype` (float32 under bf16/fp32 models,
float64 under float64); inputs are cast in, outputs cast back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the convention of fla and transformers)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, state_dtype):
    """[B,T,h,K] q/k (h key heads), [B,T,H,V] v, [B,T,H] g/beta -> [B,H,T,*] in state_dtype."""
    n_rep = v.shape[2] // q.shape[2]
    if n_rep > 1:  # each q/k head serves n_rep consecutive value heads
        q = q.repeat_interleave(n_rep, dim=2)
        k = k.repeat_interleave(n_rep, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(state_dtype) for x in (q, k, v, g, beta))
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, state_dtype=torch.float32):
    """Token-by-token reference. Returns (o [B,T,H,V] in v.dtype, final_state [B,H,K,V] in state_dtype)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state_dtype)
    B, H, T, Kd = k.shape
    Vd = v.shape[-1]
    S = (torch.zeros(B, H, Kd, Vd, dtype=state_dtype, device=v.device) if initial_state is None
         else initial_state.to(state_dtype))
    outs = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, Vd)
    return o.transpose(1, 2).to(out_dtype), S


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                           state_dtype=torch.float32):
    """Chunked gated delta rule. Same contract as `recurrent_gated_delta_rule`."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state_dtype)
    B, H, T, Kd = k.shape
    Vd = v.shape[-1]
    C = chunk_size
    S = (torch.zeros(B, H, Kd, Vd, dtype=state_dtype, device=v.device) if initial_state is None
         else initial_state.to(state_dtype))
    if T == 0:
        return v.new_zeros(B, 0, H, Vd).to(out_dtype), S
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    q, k, v = (x.reshape(B, H, n, C, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)

    G = g.cumsum(-1)                                                     # [B,H,n,C]
    diff = G[..., :, None] - G[..., None, :]                             # G_i - G_j
    lower_incl = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    # mask before exp: e^{G_i - G_j} for j > i would overflow and is never used
    D = torch.where(lower_incl, diff, torch.full_like(diff, float("-inf"))).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * D                                   # unit-lower system I + strict(A)
    strict = torch.ones(C, C, dtype=torch.bool, device=v.device).tril(-1)
    system = torch.where(strict, A, torch.zeros_like(A)) + torch.eye(C, dtype=A.dtype, device=A.device)
    U0 = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, kb * G.exp()[..., None], upper=False, unitriangular=True)
    k_dec = (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)  # [B,H,n,K,C]
    chunk_decay = G[..., -1].exp()[..., None, None]                      # [B,H,n,1,1]

    q_dec = q * G.exp()[..., None]
    intra = (q @ k.transpose(-1, -2)) * D                                # [B,H,n,C,C]
    # The sequential part: per chunk, the correction U, the output and the state. Its operands come from
    # unbind (one backward node that stacks every chunk's gradient) rather than indexing, whose backward
    # writes each chunk's gradient into a zero tensor of the whole sequence: quadratic in the chunks.
    outs = []
    for u0, w, decay, kd, qd, it in zip(U0.unbind(2), W.unbind(2), chunk_decay.unbind(2), k_dec.unbind(2),
                                        q_dec.unbind(2), intra.unbind(2)):
        u = u0 - w @ S
        outs.append(qd @ S + it @ u)
        S = S * decay + kd @ u
    o = torch.stack(outs, 2)
    o = o.reshape(B, H, n * C, Vd)[:, :, :T]
    return o.transpose(1, 2).to(out_dtype), S


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None):
    """Depthwise causal conv over time, continuing from `conv_state`.

    x: [B, T, Ch] pre-conv inputs; weight: [Ch, W] (kernel width W); conv_state: [B, Ch, W-1], the
    last W-1 inputs before x (zeros = start of sequence). Returns (y [B,T,Ch] without activation,
    new_state [B, Ch, W-1] = the last W-1 inputs of [conv_state, x])."""
    B, T, Ch = x.shape
    W = weight.shape[-1]
    xt = x.transpose(1, 2)
    if conv_state is None:
        conv_state = xt.new_zeros(B, Ch, W - 1)
    full = torch.cat([conv_state.to(xt.dtype), xt], dim=-1)              # [B, Ch, W-1+T]
    if T == 0:  # (an empty sequence-parallel piece: conv1d refuses an input shorter than its kernel)
        return x.new_zeros(B, 0, Ch), full
    y = F.conv1d(full, weight.unsqueeze(1).to(xt.dtype), groups=Ch)       # [B, Ch, T]
    new_state = full[..., full.shape[-1] - (W - 1):]
    return y.transpose(1, 2), new_state
