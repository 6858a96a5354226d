"""The gated delta rule over a piece of a sequence whose entering state is not known yet: the affine
form that lets pieces held by different ranks combine by a scan (sequence-parallel Gated DeltaNet,
LASP-2 style), exactly.

Per value head (ops/gated_delta.py's rule, S: [K, V]), token t maps the state as

    S_t = L_t S_{t-1} + beta_t k_t v_t^T,     L_t = e^{g_t} (I - beta_t k_t k_t^T)     ([K, K])
    o_t = S_t^T q_t

so a piece of tokens 1..T entered with S_in leaves S_out = M S_in + B (M = L_T ... L_1, B = the state
it leaves when entered with zero), and o_t = o0_t + S_in^T c_t with c_t = M_{<=t}^T q_t and o0_t the
zero-state output. One run of the rule gives all four: entered with [I | 0] ([K, K + V]) on values
[0 | v], its first K state columns evolve as M_{<=t} (they get no value) and the last V as the zero-
state run, so its outputs are [c_t | o0_t] and its final state [M | B]. That run is the rule's own
(plain chunked, or fla on CUDA, through ops/dispatch.py), on values K wider.

    piece_maps(q, k, v, g, beta, chunk_size, state_dtype) -> PieceMaps(c, o0, M, B)
    PieceMaps.output(S_in) -> o [B, T, H, V];  PieceMaps.state(S_in) -> S_out [B, H, K, V]
    scan(maps, S_in) -> the state entering each piece and the last one's S_out

Everything is ordinary autograd: gradients reach q, k, v, g, beta and S_in through the maps.
tests/unit/test_gdn_pieces.py holds pieces combined by the scan to the rule over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw_mcore.ops.dispatch import gdn_kernel


@dataclass
class PieceMaps:
    c: torch.Tensor    # [B, T, H, K]  M_{<=t}^T q_t (q as the rule normalises it)
    o0: torch.Tensor   # [B, T, H, V]  the output from a zero entering state
    M: torch.Tensor    # [B, H, K, K]  S_out = M S_in + B
    B: torch.Tensor    # [B, H, K, V]

    def output(self, S_in: torch.Tensor) -> torch.Tensor:
        """o_t = o0_t + S_in^T c_t (state dtype)."""
        return self.o0 + torch.einsum("bthk,bhkv->bthv", self.c, S_in.to(self.c.dtype))

    def state(self, S_in: torch.Tensor) -> torch.Tensor:
        return self.M @ S_in.to(self.M.dtype) + self.B


def piece_maps(q, k, v, g, beta, chunk_size: int = 64, state_dtype=torch.float32, rule=None) -> PieceMaps:
    """The piece's maps (module docstring). q, k [B, T, h, K]; v [B, T, H, V]; g, beta [B, T, H]: the
    rule's inputs. All four come back in `state_dtype`. `rule`: another delta rule with the same contract
    as `chunk_gated_delta_rule` whose step is affine in the state the same way (Kimi Delta Attention's, g
    [B, T, H, K]: its decay diag(e^{g_t}) multiplies the state from the left as e^{g_t} does); default the
    gated delta rule's kernel for these values."""
    Bsz, T, H, V = v.shape
    K = q.shape[-1]
    values = torch.cat([v.new_zeros(Bsz, T, H, K, dtype=state_dtype), v.to(state_dtype)], dim=-1)
    start = torch.zeros(Bsz, H, K, K + V, dtype=state_dtype, device=v.device)
    start[..., :K] = torch.eye(K, dtype=state_dtype, device=v.device)
    rule = rule or gdn_kernel(values, K).chunk_gated_delta_rule
    o, S = rule(q, k, values, g, beta, start, chunk_size=chunk_size, state_dtype=state_dtype)
    return PieceMaps(c=o[..., :K], o0=o[..., K:], M=S[..., :K], B=S[..., K:])


def scan(maps: list[PieceMaps], S_in: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The state entering each piece, in sequence order, from `S_in` entering the first; and the state
    the last one leaves."""
    entering = []
    S = S_in
    for m in maps:
        entering.append(S)
        S = m.state(S)
    return entering, S
