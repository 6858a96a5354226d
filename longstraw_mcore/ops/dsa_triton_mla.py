"""Sparse MLA attention as Triton kernels, forward and backward, behind the contracts of ops/dsa.py's
`mla_sparse_partial` and `mla_sparse` (absorbed form: the queries in latent space, the latents read
directly, the per-head K/V never expanded).

    forward   a program takes one query and BH heads: it walks the query's k selected rows in blocks of
              BK, gathers their latents c [BK, R] and RoPE keys pe [BK, Dr] inside the kernel, forms
              the logits (q_abs . c + q_pe . pe) x scale in float32 and keeps an online softmax (running
              max, sum, and the weighted latents [BH, R] in float32). Returns o_lat [B, T, H, R] (the
              softmax-weighted latents over the valid selected rows) and lse [B, T, H] (float32, -inf
              for a query with no valid row here, whose o_lat is 0), so context-parallel partials
              merge by log-sum-exp as the twin's do (parallel/cp_dsa.py)
    backward  recomputes each block's probabilities from lse (nothing [T, k] is stored) and, with
              dD = rowsum(dO o_lat) per head, dS = P (dO . c - dD + dlse): the query gradients
              dq_abs = scale dS c, dq_pe = scale dS pe (per program, no atomics), and where the latents
              take a gradient (exact mode's leaves, a prefix-tree segment's or a branch's own rows)
              dc += scale dS^T q_abs + P^T dO and dpe += scale dS^T q_pe, scatter-added into the
              selected rows with atomics in float32 (many queries select the same row). Inputs that
              need no gradient (a detached prompt state) get none: that part of the kernel is compiled
              out. Atomics make the latents' gradient's last bits depend on the order the GPU runs
              programs in (not under the interpreter, which runs them in order).

The latents may come in two parts (the prompt state's rows, then the call's own: ops/dsa.py), read where
they lie: the copy that joins them is never made, and each part's gradient buffer has that part's shape
(a detached state's none), not the joined rows'.

q_abs = q_nope W_UK and o = o_lat W_UV stay outside (dense einsums, autograd's): the kernels see
latent-space queries. Dtypes: float32 / bf16 / fp16 (float32 dots in IEEE float32, no TF32); float64
is the twin's (ops/dispatch.dsa_kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw_mcore.ops.dsa_triton_common import in_place, pow2, row_strides

BH = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are masked)
BK = 16  # selected rows per step


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _gather(p0, p1, b, row, N0, col, col_ok, in0, in1, s0_b, s0_s, s1_b, s1_s):
    """Rows `row` [BK] of a tensor kept in two parts (rows < N0 in p0, the rest in p1 from 0), [BK, cols]."""
    return (tl.load(p0 + b * s0_b + row[:, None] * s0_s + col[None, :], mask=in0[:, None] & col_ok[None, :], other=0.0)
            + tl.load(p1 + b * s1_b + (row - N0)[:, None] * s1_s + col[None, :], mask=in1[:, None] & col_ok[None, :],
                      other=0.0))


@triton.jit
def _block(qa, qp, c0_ptr, pe0_ptr, c1_ptr, pe1_ptr, idx_ptr, valid_ptr, b, t, k0, K, N0, r, r_ok, dr, dr_ok, scale,
           sc0_b, sc0_s, spe0_b, spe0_s, sc1_b, sc1_s, spe1_b, spe1_s, si_b, si_t,
           BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Selected slots [k0, k0 + BLOCK_K) of query t: (valid, rows, in head part, in tail part, their latents
    [BK, R], RoPE keys [BK, Dr], and the heads' logits [BH, BK] x scale in float32, before masking)."""
    j = k0 + tl.arange(0, BLOCK_K)
    j_ok = j < K
    v = (tl.load(valid_ptr + b * si_b + t * si_t + j, mask=j_ok, other=0) != 0) & j_ok
    row = tl.load(idx_ptr + b * si_b + t * si_t + j, mask=v, other=0)
    in0, in1 = v & (row < N0), v & (row >= N0)          # the latents' two parts: head rows, tail rows
    cs = _gather(c0_ptr, c1_ptr, b, row, N0, r, r_ok, in0, in1, sc0_b, sc0_s, sc1_b, sc1_s)
    ps = _gather(pe0_ptr, pe1_ptr, b, row, N0, dr, dr_ok, in0, in1, spe0_b, spe0_s, spe1_b, spe1_s)
    logits = (_dot(qa, tl.trans(cs), IEEE) + _dot(qp, tl.trans(ps), IEEE)) * scale
    return v, row, in0, in1, cs, ps, logits


@triton.jit
def _fwd_kernel(qa_ptr, qp_ptr, c0_ptr, pe0_ptr, c1_ptr, pe1_ptr, idx_ptr, valid_ptr, o_ptr, lse_ptr,
                H, K, R, DR, N0, scale,
                sqa_b, sqa_t, sqa_h, sqp_b, sqp_t, sqp_h, sc0_b, sc0_s, spe0_b, spe0_s, sc1_b, sc1_s, spe1_b, spe1_s,
                si_b, si_t,
                so_b, so_t, so_h, sl_b, sl_t,
                RP: tl.constexpr, DRP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                IEEE: tl.constexpr):
    t, hb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    r = tl.arange(0, RP)
    r_ok = r < R
    dr = tl.arange(0, DRP)
    dr_ok = dr < DR
    qa = tl.load(qa_ptr + b * sqa_b + t * sqa_t + h[:, None] * sqa_h + r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                 other=0.0)
    qp = tl.load(qp_ptr + b * sqp_b + t * sqp_t + h[:, None] * sqp_h + dr[None, :],
                 mask=h_ok[:, None] & dr_ok[None, :], other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, RP), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v, row, in0, in1, cs, ps, logits = _block(
            qa, qp, c0_ptr, pe0_ptr, c1_ptr, pe1_ptr, idx_ptr, valid_ptr, b, t, k0, K, N0, r, r_ok, dr, dr_ok, scale,
            sc0_b, sc0_s, spe0_b, spe0_s, sc1_b, sc1_s, spe1_b, spe1_s, si_b, si_t, BLOCK_K, IEEE)
        logits = tl.where(v[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(cs.dtype), cs, IEEE)
        m = m_new
    some = l > 0
    lse = tl.where(some, m + tl.log(tl.where(some, l, 1.0)), float("-inf"))
    o = acc / tl.where(some, l, 1.0)[:, None]
    tl.store(o_ptr + b * so_b + t * so_t + h[:, None] * so_h + r[None, :], o.to(o_ptr.dtype.element_ty),
             mask=h_ok[:, None] & r_ok[None, :])
    tl.store(lse_ptr + b * sl_b + t * sl_t + h, lse, mask=h_ok)


@triton.jit
def _scatter_add(p0, p1, b, row, N0, col, col_ok, in0, in1, s0_b, s0_s, s1_b, s1_s, val,
                 GRAD0: tl.constexpr, GRAD1: tl.constexpr):
    """Atomically add val [BK, cols] into rows `row` of the parts that take a gradient."""
    if GRAD0:
        tl.atomic_add(p0 + b * s0_b + row[:, None] * s0_s + col[None, :], val, mask=in0[:, None] & col_ok[None, :])
    if GRAD1:
        tl.atomic_add(p1 + b * s1_b + (row - N0)[:, None] * s1_s + col[None, :], val,
                      mask=in1[:, None] & col_ok[None, :])


@triton.jit
def _bwd_kernel(qa_ptr, qp_ptr, c0_ptr, pe0_ptr, c1_ptr, pe1_ptr, idx_ptr, valid_ptr, o_ptr, lse_ptr, do_ptr,
                dlse_ptr, dqa_ptr, dqp_ptr, dc0_ptr, dpe0_ptr, dc1_ptr, dpe1_ptr,
                H, K, R, DR, N0, scale,
                sqa_b, sqa_t, sqa_h, sqp_b, sqp_t, sqp_h, sc0_b, sc0_s, spe0_b, spe0_s, sc1_b, sc1_s, spe1_b, spe1_s,
                si_b, si_t, so_b, so_t, so_h, sl_b, sl_t,
                sdc0_b, sdc0_s, sdpe0_b, sdpe0_s, sdc1_b, sdc1_s, sdpe1_b, sdpe1_s,
                RP: tl.constexpr, DRP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                IEEE: tl.constexpr, HAS_DLSE: tl.constexpr, GRAD0: tl.constexpr, GRAD1: tl.constexpr):
    t, hb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    r = tl.arange(0, RP)
    r_ok = r < R
    dr = tl.arange(0, DRP)
    dr_ok = dr < DR
    hr = h_ok[:, None] & r_ok[None, :]
    hd = h_ok[:, None] & dr_ok[None, :]
    qa = tl.load(qa_ptr + b * sqa_b + t * sqa_t + h[:, None] * sqa_h + r[None, :], mask=hr, other=0.0)
    qp = tl.load(qp_ptr + b * sqp_b + t * sqp_t + h[:, None] * sqp_h + dr[None, :], mask=hd, other=0.0)
    o_off = b * so_b + t * so_t + h[:, None] * so_h + r[None, :]
    o = tl.load(o_ptr + o_off, mask=hr, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + o_off, mask=hr, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + b * sl_b + t * sl_t + h, mask=h_ok, other=float("-inf"))
    some = lse > float("-inf")
    lse_safe = tl.where(some, lse, 0.0)
    dd = tl.sum(do * o, 1)
    if HAS_DLSE:
        dd = dd - tl.load(dlse_ptr + b * sl_b + t * sl_t + h, mask=h_ok, other=0.0)
    dqa = tl.zeros((BLOCK_H, RP), tl.float32)
    dqp = tl.zeros((BLOCK_H, DRP), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v, row, in0, in1, cs, ps, logits = _block(
            qa, qp, c0_ptr, pe0_ptr, c1_ptr, pe1_ptr, idx_ptr, valid_ptr, b, t, k0, K, N0, r, r_ok, dr, dr_ok, scale,
            sc0_b, sc0_s, spe0_b, spe0_s, sc1_b, sc1_s, spe1_b, spe1_s, si_b, si_t, BLOCK_K, IEEE)
        p = tl.where(v[None, :] & some[:, None], tl.exp(logits - lse_safe[:, None]), 0.0)
        dp = _dot(do.to(cs.dtype), tl.trans(cs), IEEE)
        ds = p * (dp - dd[:, None])                                               # d logits (before scale)
        dqa += _dot(ds.to(cs.dtype), cs, IEEE)
        dqp += _dot(ds.to(ps.dtype), ps, IEEE)
        if GRAD0 or GRAD1:
            dcs = (_dot(tl.trans(ds.to(qa.dtype)), qa, IEEE) * scale
                   + _dot(tl.trans(p.to(cs.dtype)), do.to(cs.dtype), IEEE))
            _scatter_add(dc0_ptr, dc1_ptr, b, row, N0, r, r_ok, in0, in1, sdc0_b, sdc0_s, sdc1_b, sdc1_s, dcs,
                         GRAD0, GRAD1)
            dps = _dot(tl.trans(ds.to(qp.dtype)), qp, IEEE) * scale
            _scatter_add(dpe0_ptr, dpe1_ptr, b, row, N0, dr, dr_ok, in0, in1, sdpe0_b, sdpe0_s, sdpe1_b, sdpe1_s, dps,
                         GRAD0, GRAD1)
    tl.store(dqa_ptr + b * sqa_b + t * sqa_t + h[:, None] * sqa_h + r[None, :], dqa * scale, mask=hr)
    tl.store(dqp_ptr + b * sqp_b + t * sqp_t + h[:, None] * sqp_h + dr[None, :], dqp * scale, mask=hd)


def _launch(q_abs, c):
    B, T, H, R = q_abs.shape
    return (T, triton.cdiv(H, BH), B), dict(RP=pow2(R), BLOCK_H=BH, BLOCK_K=BK, IEEE=c.dtype == torch.float32,
                                           num_warps=8 if R >= 256 else 4)


def _shared_args(q_abs, q_pe, c0, pe0, c1, pe1, idx, o, lse) -> tuple:
    """The strides both kernels take, in their order: queries, the latents' and RoPE keys' two parts,
    the selection, o_lat, lse."""
    parts = tuple(s for x in (c0, pe0, c1, pe1) for s in row_strides(x))
    return (*q_abs.stride()[:3], *q_pe.stride()[:3], *parts, idx.stride(0), idx.stride(1), *o.stride()[:3],
            lse.stride(0), lse.stride(1))


class _SparsePartial(torch.autograd.Function):
    """(q_abs, q_pe, c0, pe0, c1, pe1, idx, valid, scale) -> (o_lat, lse). The latents and RoPE keys in two
    parts, rows [0, N0) in (c0, pe0) and the rest in (c1, pe1) (a single tensor: c1 is c0 and N0 its rows);
    each part gets a gradient of its own shape, or none where it takes none."""

    @staticmethod
    def forward(ctx, q_abs, q_pe, c0, pe0, c1, pe1, idx, valid, scale, single):
        q_abs, q_pe = q_abs.contiguous(), q_pe.contiguous()
        c0, pe0, c1, pe1 = (in_place(x) for x in (c0, pe0, c1, pe1))
        idx, valid = idx.contiguous(), valid.contiguous().to(torch.int8)
        B, T, H, R = q_abs.shape
        K, DR = idx.shape[-1], q_pe.shape[-1]
        n0 = c0.shape[1]
        o = torch.empty(B, T, H, R, dtype=c0.dtype, device=c0.device)
        lse = torch.empty(B, T, H, dtype=torch.float32, device=c0.device)
        if T and H:
            grid, meta = _launch(q_abs, c0)
            _fwd_kernel[grid](q_abs, q_pe, c0, pe0, c1, pe1, idx, valid, o, lse, H, K, R, DR, n0, scale,
                              *_shared_args(q_abs, q_pe, c0, pe0, c1, pe1, idx, o, lse), DRP=pow2(DR), **meta)
        ctx.save_for_backward(q_abs, q_pe, c0, pe0, c1, pe1, idx, valid, o, lse)
        ctx.scale, ctx.single = scale, single
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q_abs, q_pe, c0, pe0, c1, pe1, idx, valid, o, lse = ctx.saved_tensors
        B, T, H, R = q_abs.shape
        K, DR = idx.shape[-1], q_pe.shape[-1]
        need = ctx.needs_input_grad
        grad0 = need[2] or need[3]
        grad1 = not ctx.single and (need[4] or need[5])
        do = torch.zeros_like(o) if do is None else do.contiguous()
        dqa, dqp = torch.empty_like(q_abs), torch.empty_like(q_pe)
        f32 = dict(dtype=torch.float32, device=o.device)
        dc0, dpe0 = (torch.zeros(c0.shape, **f32), torch.zeros(pe0.shape, **f32)) if grad0 else (dqa, dqa)
        dc1, dpe1 = (torch.zeros(c1.shape, **f32), torch.zeros(pe1.shape, **f32)) if grad1 else (dqa, dqa)
        if T and H:
            grid, meta = _launch(q_abs, c0)
            _bwd_kernel[grid](q_abs, q_pe, c0, pe0, c1, pe1, idx, valid, o, lse, do,
                              dlse.contiguous() if dlse is not None else lse, dqa, dqp, dc0, dpe0, dc1, dpe1,
                              H, K, R, DR, c0.shape[1], ctx.scale,
                              *_shared_args(q_abs, q_pe, c0, pe0, c1, pe1, idx, o, lse),
                              *(s for x in (dc0, dpe0, dc1, dpe1) for s in row_strides(x)),
                              DRP=pow2(DR), HAS_DLSE=dlse is not None, GRAD0=grad0, GRAD1=grad1, **meta)
        grads = [dc0.to(c0.dtype) if grad0 and need[2] else None, dpe0.to(pe0.dtype) if grad0 and need[3] else None,
                 dc1.to(c1.dtype) if grad1 and need[4] else None, dpe1.to(pe1.dtype) if grad1 and need[5] else None]
        return (dqa, dqp, *grads, None, None, None, None)


def mla_sparse_partial(q_nope, q_pe, c_kv, k_pe, w_uk, idx, valid, scale: float,
                       query_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/dsa.mla_sparse_partial's contract: (o_lat [B, T, H, R], lse [B, T, H] float32). `c_kv`, `k_pe`: tensors
    or (head, tail) pairs of their rows (ops/dsa.py), read where they lie. `query_block` is the twin's memory
    bound (its gathered latents); the kernel gathers none, so it does not apply."""
    q_abs = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)
    if isinstance(c_kv, tuple):
        (c0, c1), (pe0, pe1) = c_kv, k_pe
        return _SparsePartial.apply(q_abs, q_pe, c0, pe0, c1.to(c0.dtype), pe1.to(pe0.dtype), idx, valid, scale, False)
    return _SparsePartial.apply(q_abs, q_pe, c_kv, k_pe, c_kv, k_pe, idx, valid, scale, True)


def mla_sparse(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid, scale: float, query_block: int = 0) -> torch.Tensor:
    """ops/dsa.mla_sparse's contract: [B, T, H, Dv]."""
    o_lat, _ = mla_sparse_partial(q_nope, q_pe, c_kv, k_pe, w_uk, idx, valid, scale)
    return torch.einsum("bthr,hvr->bthv", o_lat, w_uv)
