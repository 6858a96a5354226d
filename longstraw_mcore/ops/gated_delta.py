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
replay use. The chunked form does the intra-chunk work for every chunk and head at once (chunk-major,
[n, B*H, C, *]); only the state recurrence loops over chunks, two products per chunk. With a graph the
loop is one autograd node (`_StateLoop`: its backward is the reverse recurrence, two products per
chunk) and the outputs one batched product over the entering states it keeps; without a graph it holds
one state at a time and writes each chunk's output in the loop. A sequence that is not a whole number
of chunks ends with a chunk of its own length (no padding). Everything runs in `state_dtype` (float32
under bf16/fp32 models, float64 under float64); inputs are cast in, outputs cast back.
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


def entering_state(initial_state, B: int, H: int, Kd: int, Vd: int, state_dtype, device) -> torch.Tensor:
    """The state a rule starts from: `initial_state` in state_dtype, or zeros [B, H, K, V]."""
    if initial_state is None:
        return torch.zeros(B, H, Kd, Vd, dtype=state_dtype, device=device)
    return initial_state.to(state_dtype)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, state_dtype=torch.float32):
    """Token-by-token reference. Returns (o [B,T,H,V] in v.dtype, final_state [B,H,K,V] in state_dtype)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state_dtype)
    B, H, T, Kd = k.shape
    Vd = v.shape[-1]
    S = entering_state(initial_state, B, H, Kd, Vd, state_dtype, v.device)
    o, S = delta_recurrence(q, k, v, g.exp()[..., None, None], beta, S)
    return o.to(out_dtype), S


def delta_recurrence(q, k, v, decay, beta, S):
    """The delta rule token by token on [B,H,T,*] inputs from state S [B,H,K,V]: S_t = decay_t * S_{t-1} (decay
    [B,H,T,1,1] one per head, or [B,H,T,K,1] per key channel), then the delta update and o_t = S_t^T q_t.
    Returns (o [B,T,H,V], S)."""
    outs = []
    for t in range(v.shape[2]):
        S = S * decay[:, :, t]
        kv_mem = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(*v.shape[:2], 0, v.shape[-1])
    return o.transpose(1, 2), S


class _StateLoop(torch.autograd.Function):
    """The chunk loop's sequential part with autograd, chunk-major ([n, BH, ...]):

        u_i = u0_i - w_i S_i,    S_{i+1} = d_i S_i + kd_i u_i        (S_0 = s0)

    Returns (u [n, BH, C, V], S_1 .. S_{n-1} [n - 1, BH, K, V], S_n): the tensors autograd would keep
    for the plain loop anyway, written in place (S_0 is the caller's, not copied). Its backward runs the
    recurrence in reverse, two products per chunk (du_i = dU_i + kd_i^T dS_{i+1},
    dS_i = dE_i + d_i dS_{i+1} - w_i^T du_i), and the gradients of w, kd and d for all chunks at once
    afterwards: autograd over the plain loop runs ~20 nodes per chunk, which at 32-wide heads cost more
    than their products. Like autograd it skips what nobody needs (S_0's gradient when s0 is a
    constant, the last update's when S_n is unused), so the products and FLOPs are the plain loop's.
    Products go through out= (FlopCounterMode counts them; it has no formula for in-place baddbmm_)."""

    @staticmethod
    def forward(ctx, u0, w, decay, kd, s0):
        n = u0.shape[0]
        rest = s0.new_empty((n - 1,) + tuple(s0.shape))
        u = torch.empty_like(u0)
        S = s0
        for i in range(n):
            torch.baddbmm(u0[i], w[i], S, alpha=-1, out=u[i])
            nxt = rest[i] if i + 1 < n else s0.new_empty(s0.shape)
            torch.baddbmm(S * decay[i][:, None, None], kd[i], u[i], out=nxt)
            S = nxt
        ctx.save_for_backward(w, decay, kd, s0, rest, u)
        ctx.set_materialize_grads(False)
        return u, rest, S

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_u, d_rest, d_final):
        w, decay, kd, s0, rest, u = ctx.saved_tensors
        n = u.shape[0]
        du = torch.zeros_like(u) if d_u is None else d_u.clone()
        after = u.new_empty((n,) + tuple(s0.shape))    # after[i] = dS_{i+1}
        first = n - 1 if d_final is None else n        # the chunks whose dS_{i+1} may be nonzero
        if d_final is None:
            after[n - 1].zero_()
        else:
            after[n - 1].copy_(d_final)
        d_s0 = None
        for i in range(n - 1, -1, -1):
            if i < first:
                torch.baddbmm(du[i], kd[i].transpose(-1, -2), after[i], out=du[i])
            if i == 0 and not ctx.needs_input_grad[4]:
                break
            carried = after[i] * decay[i][:, None, None]
            if i and d_rest is not None:
                carried += d_rest[i - 1]
            dst = after[i - 1] if i else torch.empty_like(s0)
            torch.baddbmm(carried, w[i].transpose(-1, -2), du[i], alpha=-1, out=dst)
            if not i:
                d_s0 = dst
        d_w = d_kd = d_decay = None
        if ctx.needs_input_grad[1]:
            d_w = torch.empty_like(w)
            torch.bmm(du[0], s0.transpose(-1, -2), out=d_w[0])
            torch.matmul(du[1:], rest.transpose(-1, -2), out=d_w[1:])
            d_w.neg_()
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[2]:   # (scratch kept to the outputs' size)
            d_kd, d_decay = torch.empty_like(kd), torch.empty_like(decay)
            torch.matmul(after[:first], u[:first].transpose(-1, -2), out=d_kd[:first])
            d_kd[first:].zero_()
            d_decay[first:].zero_()
            if first:
                torch.sum(after[0].mul_(s0), (-1, -2), out=d_decay[0])
                torch.sum(after[1:first].mul_(rest[:first - 1]), (-1, -2), out=d_decay[1:first])
        return du, d_w, d_decay, d_kd, d_s0


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                           state_dtype=torch.float32):
    """Chunked gated delta rule. Same contract as `recurrent_gated_delta_rule`. A sequence that is not
    a whole number of chunks ends with one chunk of its own length, continuing from the state the
    whole chunks leave: nothing is padded, so a short replay segment or tail costs its own tokens."""
    return with_tail(_whole_chunks, q, k, v, g, beta, initial_state, chunk_size, state_dtype)


def with_tail(whole_chunks, q, k, v, g, beta, initial_state, chunk_size: int, state_dtype):
    """A chunked rule `whole_chunks(q, k, v, g, beta, state, C, state_dtype)` over any length: the whole chunks,
    then the rest as one chunk of its own length from the state they leave (inputs [B, T, ...])."""
    T = v.shape[1]
    cut = T - T % chunk_size
    if 0 < cut < T:
        o, S = whole_chunks(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state,
                            chunk_size, state_dtype)
        o_tail, S = whole_chunks(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], S, T - cut,
                                 state_dtype)
        return torch.cat([o, o_tail], 1), S
    return whole_chunks(q, k, v, g, beta, initial_state, min(chunk_size, T) or chunk_size, state_dtype)


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
    # chunk-major [n, B*H, C, *]: chunk i's operands are contiguous batches for the loop's products
    q, k, v = (x.reshape(B * H, n, C, -1).transpose(0, 1).contiguous() for x in (q, k, v))
    g, beta = (x.reshape(B * H, n, C).transpose(0, 1).contiguous() for x in (g, beta))

    G = g.cumsum(-1)                                                     # [n,BH,C]
    eG = G.exp()
    above = torch.ones(C, C, dtype=torch.bool, device=v.device).triu(1)
    # D_ij = e^{G_i - G_j}, masked before exp (for j > i it would overflow and is never used); in place:
    # the difference is a new tensor and neither the mask nor the subtraction needs it for the backward
    D = (G[..., :, None] - G[..., None, :]).masked_fill_(above, float("-inf")).exp_()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * D
    # the system is I + strict_lower(A): a unit-triangular solve reads neither A's diagonal nor its upper
    # part (zero anyway) and gives them no gradient, so A goes in as it is
    rhs = torch.cat([v * beta[..., None], kb * eG[..., None]], dim=-1)   # one solve for both
    U0, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([Vd, Kd], -1)
    del rhs
    k_dec = (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)  # [n,BH,K,C]
    chunk_decay = G[..., -1].exp()                                       # [n,BH]
    q_dec = q * eG[..., None]
    intra = (q @ k.transpose(-1, -2)) * D                                # [n,BH,C,C]
    S = S.reshape(B * H, Kd, Vd)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (U0, W, chunk_decay, k_dec, S)):
        u, rest, S_n = _StateLoop.apply(U0, W, chunk_decay, k_dec, S)
        # every chunk's output at once: o_i = (Q e^G)_i S_i + (Q K^T * D)_i u_i
        o = torch.cat([(q_dec[0] @ S)[None], q_dec[1:] @ rest]) + intra @ u
        S = S_n
    else:  # no graph: one state at a time (a long capture must not hold every chunk's entering state)
        o = U0.new_empty(n, B * H, C, Vd)
        for i in range(n):
            u = torch.baddbmm(U0[i], W[i], S, alpha=-1)
            torch.baddbmm(torch.bmm(q_dec[i], S, out=o[i]), intra[i], u, out=o[i])
            S = torch.baddbmm(S * chunk_decay[i][:, None, None], k_dec[i], u)
    o = o.reshape(n, B, H, C, Vd).permute(1, 0, 3, 2, 4).reshape(B, T, H, Vd)
    return o.to(out_dtype), S.reshape(B, H, Kd, Vd)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
                  activation: str | None = None):
    """Depthwise causal conv over time, continuing from `conv_state`.

    x: [B, T, Ch] pre-conv inputs; weight: [Ch, W] (kernel width W); conv_state: [B, Ch, W-1], the
    last W-1 inputs before x (zeros = start of sequence); activation: None or "silu". Returns
    (y [B,T,Ch], new_state [B, Ch, W-1] = the last W-1 inputs of [conv_state, x])."""
    if activation not in (None, "silu"):
        raise ValueError(f"activation={activation!r}: must be None or 'silu'")
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
    y = y.transpose(1, 2)
    return (F.silu(y) if activation == "silu" else y), new_state
