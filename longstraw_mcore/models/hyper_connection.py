"""Hyper-connection residual streams (manifold-constrained, mHC) of GLM-5.3-Flash: the computation.

Each position carries N = hc_mult residual streams of width H instead of one. Around every sublayer (the
token mixer, the MLP) a `HyperConnection` reads the N streams and makes three sets of weights, per position:
    f    = x / rms(x), x the N streams flattened to N*H (no weight), in float32 or wider
    m    = f fn^T                                   fn [(N+2)N, N*H]; m split into pre [N], post [N], comb [N, N]
    pre  = sigmoid(m_pre s_pre + b_pre) + eps       post = 2 sigmoid(m_post s_post + b_post)
    comb = softmax_rows(m_comb s_comb + b_comb) + eps, then made doubly stochastic by Sinkhorn: columns, and
           (iters - 1) times rows then columns, each division with + eps
    y    = sum_i pre_i stream_i                     the sublayer's input [.., H] (it is normalised next)
and `mix` joins the sublayer's output o back: stream'_j = post_j o + sum_i comb_ij stream_i. `head` averages
the streams at the model's end, `expand` copies the embedding into N streams at its start.

Streams hold nothing across positions: no prompt state. Tensors are [..., N, H] with any leading dims
([T, B] in Megatron's layout); the weights are computed in the wider of the input dtype and float32 and cast
to the input dtype before mixing, as transformers does (tests/unit/test_hyper_connection.py holds this to
`Glm5NextTextHyperConnection` and the decoder layer's mixing).
"""

from __future__ import annotations

import torch

from longstraw_mcore.models.norms import RMSNorm


class HyperConnection(torch.nn.Module):
    """The weights of one sublayer's hyper-connection: fn [(N+2)N, N*H], base [(N+2)N] and scale [3] (base and
    scale kept in float32 or wider, as transformers keeps them)."""

    def __init__(self, hidden_size: int, n: int, sinkhorn_iters: int, eps: float, norm_eps: float,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if n < 1 or sinkhorn_iters < 1:
            raise ValueError(f"hyper-connection: hc_mult={n} and hc_sinkhorn_iters={sinkhorn_iters} must be >= 1")
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        width = (n + 2) * n
        wide = torch.promote_types(dtype, torch.float32)
        self.fn = torch.nn.Parameter(torch.zeros(width, n * hidden_size, dtype=dtype, device=device))
        self.base = torch.nn.Parameter(torch.zeros(width, dtype=wide, device=device))
        self.scale = torch.nn.Parameter(torch.zeros(3, dtype=wide, device=device))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [..., N, H] -> (post [..., N], comb [..., N, N], y [..., H] in the streams' dtype).

        Under autograd the weights are recomputed in the backward from the streams (which the mix keeps anyway)
        instead of keeping the float32 normalised streams and every Sinkhorn step: per token and sublayer that
        is 8 N H bytes and ~2 iters N^2 values less, for one more f fn^T (planner/flops_glm5_next.py)."""
        if torch.is_grad_enabled() and (streams.requires_grad or self.fn.requires_grad):
            from torch.utils.checkpoint import checkpoint

            pre, post, comb = checkpoint(self.weights, streams, use_reentrant=False, preserve_rng_state=False)
        else:
            pre, post, comb = self.weights(streams)
        y = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, y

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [..., N, H] -> (pre [..., N], post [..., N], comb [..., N, N]), in the wider of the streams'
        dtype and float32."""
        n = self.n
        dt = torch.promote_types(streams.dtype, torch.float32)
        flat = streams.flatten(-2).to(dt)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        m = flat @ self.fn.to(dt).t()
        pre_w, post_w, comb_w = m.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.to(dt).split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.to(dt).unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return pre, post, comb


def mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a sublayer: post_j out + sum_i comb_ij stream_i ([..., N, H]; out [..., H])."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dt).transpose(-1, -2) @ streams


def expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """[..., H] -> N identical streams [..., N, H] (the embedding's output at the model's start)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])


def head(streams: torch.Tensor) -> torch.Tensor:
    """[..., N, H] -> their mean [..., H] (before the final norm)."""
    return streams.mean(dim=-2)


# --- Megatron TransformerLayer slots ------------------------------------------------------------------------
# Between layers (and pipeline stages) the residual is the N streams flattened, [T, B, N*H]. A layer's
# `input_layernorm` / `pre_mlp_layernorm` slot is an `HCNorm`: it makes the sublayer's input (the streams
# collapsed by `pre`, then RMSNorm) and hands Megatron a residual `(streams, post, comb)`, which the layer
# passes to its `self_attn_bda` / `mlp_bda` slot, `hc_bda`, that mixes the sublayer's output back in. The
# block's final `layer_norm` slot is `HCHead` (mean of the streams, RMSNorm). No Megatron class is forked.


class HCNorm(RMSNorm):
    """A sublayer's hyper-connection + its RMSNorm (`weight`), in a Megatron norm slot `(config, hidden_size,
    eps)` with `model_cfg` bound: [T, B, N*H] -> (y [T, B, H], residual (streams [T, B, N, H], post, comb))."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, model_cfg=None, **kwargs):
        super().__init__(config, hidden_size, eps=eps)
        m = model_cfg
        self.n = m.hc_mult
        self.hc = HyperConnection(hidden_size, m.hc_mult, m.hc_sinkhorn_iters, m.hc_eps, m.rms_norm_eps,
                                  dtype=config.params_dtype)

    def forward(self, flat: torch.Tensor):
        streams = flat.unflatten(-1, (self.n, -1))
        post, comb, y = self.hc(streams)
        return super().forward(y), (streams, post, comb)


def _hc_add(out_with_bias, residual, prob):
    out, bias = out_with_bias
    if bias is not None:
        out = out + bias
    streams, post, comb = residual
    return mix(streams, out, post, comb).flatten(-2)


def hc_bda(training: bool = False, fused: bool = False):
    """Megatron's bias-dropout-add slot for the streams: (out [T, B, H], bias) and the `HCNorm` residual ->
    the new streams [T, B, N*H]. Dropout is not applied (the family trains without it: hidden_dropout 0)."""
    return _hc_add


class HCHead(RMSNorm):
    """The block's final norm slot: [T, B, N*H] -> RMSNorm(mean of the streams) [T, B, H]."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, model_cfg=None, **kwargs):
        super().__init__(config, hidden_size, eps=eps)
        self.n = model_cfg.hc_mult

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        return super().forward(head(flat.unflatten(-1, (self.n, -1))))
