"""The flash-attention adapter (ops/flash_attention.py) against the plain twin, float64, <= 1e-12, on
CPU, two ways (the `flash` fixture's parameter):
  - "cpu": torch's real CPU op (top-left causal: the square pieces of `_calls`);
  - "cuda-contract": the CUDA op's two calls replaced by a plain implementation of its documented
    contract (q [B,T,Hq,D], k/v [B,S,Hk,*] with Hq a multiple of Hk, causal = bottom-right aligned, lse
    [B,Hq,T] with +inf for rows that see no key; the backward computes its row term as rowsum(dO * O)
    from the out it is given), so what is tested is everything around that op (the real one is compared
    with the twin on a GPU: tests/gpu/test_flash_attention.py).
Covered: masks from absolute positions (all visible, aligned, visible prefix, nothing visible, rows with
no key), a batch-1 state folded into one sequence or expanded, GQA, the merged lse, a delta that carries
-dlse (through O'), the plain fallbacks (dO = 0 rows; on CPU values of another head dim), state sinks
with a scale, and the merged-attention node end to end. Also: the dispatch and its overrides."""

from __future__ import annotations

import pytest
import torch

F64 = torch.float64


def _contract_forward(q, k, v, causal, scale):
    B, T, Hq, _ = q.shape
    S, Hk = k.shape[1], k.shape[2]
    kh, vh = k.repeat_interleave(Hq // Hk, 2), v.repeat_interleave(Hq // Hk, 2)
    s = torch.einsum("bthd,bshd->bhts", q, kh) * scale
    if causal:
        s = s.masked_fill(torch.arange(S)[None, :] > torch.arange(T)[:, None] + S - T, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]))
    return torch.einsum("bhts,bshd->bthd", p, vh).to(q.dtype), lse.masked_fill(torch.isneginf(lse), float("inf"))


def _contract_backward(do, q, k, v, out, lse, causal, scale):
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    r = Hq // Hk
    kh, vh = k.repeat_interleave(r, 2), v.repeat_interleave(r, 2)
    s = torch.einsum("bthd,bshd->bhts", q, kh) * scale
    p = torch.exp(s - lse[..., None])
    if causal:
        p = p.masked_fill(torch.arange(S)[None, :] > torch.arange(T)[:, None] + S - T, 0.0)
    row = (do * out).sum(-1).transpose(1, 2)                                    # [B,Hq,T]
    ds = p * (torch.einsum("bthd,bshd->bhts", do, vh) - row[..., None])
    dq = torch.einsum("bhts,bshd->bthd", ds, kh) * scale
    dk = (torch.einsum("bhts,bthd->bshd", ds, q) * scale).reshape(B, S, Hk, r, D).sum(3)
    dv = torch.einsum("bhts,bthd->bshd", p, do).reshape(B, S, Hk, r, -1).sum(3)
    return dq, dk, dv


@pytest.fixture(params=["cpu", "cuda-contract"])
def flash(request, monkeypatch):
    from longstraw_mcore.ops import flash_attention

    if request.param == "cuda-contract":
        monkeypatch.setattr(flash_attention, "_ops", lambda q: (_contract_forward, _contract_backward, True, q.dtype))
    flash_attention.kind = request.param
    return flash_attention


CASES = [  # (name, B, Bk, T, S, q_start, k_start)
    ("state, every key visible, batch folded", 3, 1, 5, 23, 23, 0),
    ("own keys, aligned causal", 2, 2, 7, 7, 30, 30),
    ("visible prefix of the keys", 2, 2, 6, 20, 10, 0),
    ("rows that see no key", 1, 1, 8, 10, 0, 5),
    ("causal over a batch-1 set (expanded)", 2, 1, 4, 9, 5, 0),
    ("nothing visible", 2, 2, 5, 4, 0, 30),
    ("keys ending before the last query", 2, 2, 6, 5, 3, 0),
    ("rows without keys, masked rows and rows seeing every key", 1, 1, 8, 4, 0, 3),
    ("one query seeing every key but the last", 2, 1, 1, 7, 5, 0),
]


@pytest.mark.parametrize("name,B,Bk,T,S,q_start,k_start", CASES, ids=[c[0] for c in CASES])
def test_partials_equal_the_plain_twin(flash, name, B, Bk, T, S, q_start, k_start):
    from longstraw_mcore.ops import block_attention as plain

    g = torch.Generator().manual_seed(sum(map(ord, name)))
    dv = 8 if flash.kind == "cpu" else 6   # (the CPU op needs the value head dim to be the queries')
    q = torch.randn(B, T, 4, 8, generator=g, dtype=F64)
    k, v = torch.randn(Bk, S, 2, 8, generator=g, dtype=F64), torch.randn(Bk, S, 2, dv, generator=g, dtype=F64)
    scale = 0.3
    ref_o, ref_l, _ = plain.partial_forward(q, k, v, q_start, k_start, scale, 4, False)
    got_o, got_l, _ = flash.partial_forward(q, k, v, q_start, k_start, scale, 4, False)
    # contiguous like the twin's: callers reduce partials across context-parallel ranks (a folded batch's
    # transposed view once made cp=2 sampling draw other tokens)
    assert got_o.is_contiguous() and got_l.is_contiguous()
    assert torch.equal(torch.isneginf(got_l), torch.isneginf(ref_l))
    fin = ~torch.isneginf(ref_l)
    assert float((got_l[fin] - ref_l[fin]).abs().sum()) <= 1e-12 * max(1, int(fin.sum()))
    assert (got_o - ref_o).abs().max() <= 1e-12
    # the merged lse: this set's plus another set's (every row sees at least that one)
    lse = torch.logaddexp(ref_l, torch.randn(B, 4, T, generator=g, dtype=F64))
    do = torch.randn(B, 4, T, dv, generator=g, dtype=F64)
    delta = torch.randn(B, 4, T, generator=g, dtype=F64)                 # rowsum(dO * O) - dlse: any numbers
    for sink_scale in (None, 0.5):
        sinks = {}
        res = {}
        for kern in (plain, flash):
            sink = None
            if sink_scale is not None:
                if Bk != 1:
                    continue
                sink = (torch.zeros(1, S, 2, 8, dtype=F64), torch.zeros(1, S, 2, dv, dtype=F64))
            res[kern] = kern.partial_backward(q, k, v, do, delta, lse, q_start, k_start, scale, 4, None, True, True,
                                              True, sink=sink, sink_scale=sink_scale or 1.0)
            sinks[kern] = sink
        if not res:
            continue
        for a, b in zip(res[flash], res[plain]):
            assert (a is None) == (b is None) and (a is None or (a - b).abs().max() <= 1e-12)
        if sink_scale is not None:
            for a, b in zip(sinks[flash], sinks[plain]):
                assert (a - b).abs().max() <= 1e-12


def test_zero_output_gradient_with_a_row_term_falls_back_to_plain(flash):
    from longstraw_mcore.ops import block_attention as plain

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g, dtype=F64), torch.randn(1, 9, 2, 8, generator=g, dtype=F64),
               torch.randn(1, 9, 2, 8, generator=g, dtype=F64))
    _, lse, _ = plain.partial_forward(q, k, v, 9, 0, 0.35, 4, False)
    do = torch.randn(1, 2, 4, 8, generator=g, dtype=F64)
    do[0, 1, 2] = 0.0                                # dO = 0 on one row, but dlse != 0 there: delta != 0
    delta = torch.randn(1, 2, 4, generator=g, dtype=F64)
    a = flash.partial_backward(q, k, v, do, delta, lse, 9, 0, 0.35, 4, None, True, True, True)
    b = plain.partial_backward(q, k, v, do, delta, lse, 9, 0, 0.35, 4, None, True, True, True)
    for x, y in zip(a, b):
        assert (x - y).abs().max() <= 1e-12


def test_merged_attention_through_the_dispatch(flash, monkeypatch):
    """The model's entry point with the flash kernels (forced through the dispatch): a state set with a
    float64 sink and a branch's own keys; the loss uses lse too (dlse != 0)."""
    from longstraw_mcore.ops import block_attention as plain
    from longstraw_mcore.ops import dispatch
    from longstraw_mcore.ops.attention import KeySet, attention

    g = torch.Generator().manual_seed(7)
    base = {n: torch.randn(*s, generator=g, dtype=F64) for n, s in
            dict(q=(2, 9, 4, 16), kb=(2, 9, 2, 16), vb=(2, 9, 2, 16), kp=(1, 40, 2, 16), vp=(1, 40, 2, 16)).items()}
    res = {}
    for name in ("plain", "flash"):
        monkeypatch.setattr(dispatch, "attention_kernel", lambda q: flash if name == "flash" else plain)
        t = {n: x.clone().requires_grad_(n in ("q", "kb", "vb")) for n, x in base.items()}
        sink = (torch.zeros(1, 40, 2, 16, dtype=F64), torch.zeros(1, 40, 2, 16, dtype=F64))
        out, lse = attention(t["q"], [KeySet(t["kp"], t["vp"], 0, grad=sink), KeySet(t["kb"], t["vb"], 40)], 40, block=8)
        (out.pow(2).sum() + lse.sum()).backward()
        res[name] = [out, lse, t["q"].grad, t["kb"].grad, t["vb"].grad, *sink]
    for a, b in zip(res["flash"], res["plain"]):
        assert (a - b).abs().max() <= 1e-12 * max(1.0, float(b.abs().max()))


def test_cpu_op_falls_back_where_it_does_not_apply():
    """Values with another head dim than the queries (the CPU op refuses them): the plain twin's numbers,
    bit for bit; bf16 runs the op in float32 (the twin's work dtype): within float32 rounding of the twin."""
    from longstraw_mcore.ops import block_attention as plain
    from longstraw_mcore.ops import flash_attention as flash

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g, dtype=F64), torch.randn(2, 9, 2, 8, generator=g, dtype=F64),
               torch.randn(2, 9, 2, 6, generator=g, dtype=F64))
    for a, b in zip(flash.partial_forward(q, k, v, 4, 0, 0.3, 4, False)[:2], plain.partial_forward(q, k, v, 4, 0, 0.3, 4, False)[:2]):
        assert torch.equal(a, b)
    v = torch.randn(2, 9, 2, 8, generator=g, dtype=F64)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    (fo, fl, _), (po, pl, _) = flash.partial_forward(qb, kb, vb, 4, 0, 0.3, 4, False), plain.partial_forward(qb, kb, vb, 4, 0, 0.3, 4, False)
    assert fo.dtype == po.dtype == torch.float32 and fl.dtype == torch.float32
    assert float((fo - po).abs().max()) <= 1e-5 and float((fl - pl).abs().max()) <= 1e-5


def test_dispatch_and_overrides(monkeypatch):
    from longstraw_mcore.config import ConfigError, OpsConfig, load_config
    from longstraw_mcore.ops import block_attention, dispatch, flash_attention

    q = torch.randn(1, 2, 4, 8)
    for dt in (torch.float32, torch.float64, torch.bfloat16):                   # CPU: torch's fused op
        assert dispatch.attention_kernel(q.to(dt)) is flash_attention
    with dispatch.override(attention="plain"):
        assert dispatch.attention_kernel(q) is block_attention
    with dispatch.override(attention="flash"):
        assert dispatch.attention_kernel(q) is flash_attention
        monkeypatch.setattr(flash_attention, "available", lambda q=None: False)  # a torch without the op
        with pytest.raises(ValueError, match="ops.attention=flash needs CPU queries, or CUDA bf16"):
            dispatch.attention_kernel(q)
    monkeypatch.undo()
    assert dispatch._choice.attention == "auto"                                 # restored after the block
    with pytest.raises(ConfigError, match=r"ops.attention='fast': must be one of \['auto', 'plain', 'flash'\]"):
        dispatch.override(attention="fast").__enter__()
    assert dispatch._choice.attention == "auto"
    with pytest.raises(ConfigError, match="ops.attention"):
        load_config("configs/qwen3.6-tiny.yaml", ["ops.attention=fast"])
    with pytest.raises(ConfigError, match="ops.gdn"):
        OpsConfig(gdn="fast")
    # the op for a non-CPU tensor is the CUDA pair (CPU tests replace `_ops`; this is what the GPU runs)
    fwd, bwd, bottom_right, dt = flash_attention._ops(torch.empty(1, dtype=torch.bfloat16, device="meta"))
    assert (fwd, bwd, bottom_right, dt) == (flash_attention._op_forward, flash_attention._op_backward, True,
                                            torch.bfloat16)
    assert load_config("configs/qwen3.6-tiny.yaml", ["ops.attention=plain"]).ops.attention == "plain"


def test_planner_kernel_name_is_the_dispatch_choice():
    """ops/kernel_choice.py names, from names alone, the kernel the dispatch takes for real tensors (the
    planner's attention terms follow it): every choice x CPU dtype x head dims; CUDA's rule by name."""
    from longstraw_mcore.ops import block_attention, dispatch, flash_attention
    from longstraw_mcore.ops.kernel_choice import attention_kernel_name

    for choice in ("auto", "plain", "flash"):
        for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            q = torch.randn(1, 2, 4, 8, dtype=dt)
            with dispatch.override(attention=choice):
                kern = dispatch.attention_kernel(q)
            name = attention_kernel_name(choice, "cpu", str(dt).removeprefix("torch."), 8)
            assert (kern is flash_attention) == (name == "flash") and (kern is block_attention) == (name == "plain")
        assert attention_kernel_name(choice, "cpu", "float32", 8, value_head_dim=16) == "plain"  # (the op needs Dv = D)
    assert [attention_kernel_name("auto", "cuda", d, 128) for d in ("bfloat16", "float16", "float32")] == \
        ["flash", "flash", "plain"]
    assert attention_kernel_name("auto", "cuda", "bfloat16", 512) == "plain"          # head dim > 256
    assert attention_kernel_name("flash", "meta", "bfloat16", 64) == "plain"
