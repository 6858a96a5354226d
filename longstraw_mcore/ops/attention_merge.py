"""The log-sum-exp maths every merged-attention node shares (ops/attention.py, parallel/cp_attention.py,
parallel/kv_group.py): one softmax over several key sets from their partials, and the row terms its
backward hands every set.

Shapes (package legend): O_j [B, H, T, Dv] and lse_j [B, H, T] per key set j, in the work dtype.

    merge      lse = log sum_j exp(lse_j),   O = sum_j exp(lse_j - lse) O_j       (rows that see no key:
               O = 0, lse = -inf)
    backward   delta = rowsum(dO * O) - dlse, shared by every set: with the *merged* lse each set's
               p_ij = exp(s_ij - lse_i) is its exact share of the one softmax (ops/block_attention.py)
No autograd here: the callers are autograd Functions that save only the merged output.
"""

from __future__ import annotations

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, softmax and merges run in float32 (float64 under float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def backward_terms(dout, dlse, out, lse, work):
    """(dO [B,H,T,Dv], delta [B,H,T], lse [B,H,T]) in the work dtype from an attention node's saved
    out [B,T,H,Dv] / lse [B,T,H] and incoming gradients: delta = rowsum(dO * O) - dlse."""
    do = (torch.zeros_like(out) if dout is None else dout).to(work).transpose(1, 2)
    delta = (do * out.to(work).transpose(1, 2)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(work).transpose(1, 2)
    return do, delta, lse.to(work).transpose(1, 2)


def unpack_saved(saved, n: int):
    """What a merged-attention node saved for `n` key sets: (q, the 2n key/value tensors, out, lse,
    whatever it saved after them)."""
    return saved[0], saved[1:1 + 2 * n], saved[1 + 2 * n], saved[2 + 2 * n], saved[3 + 2 * n:]


def merge_partials(parts, shape, work, device):
    """One softmax over several key sets from their partials (O_j [B,H,T,Dv], lse_j [B,H,T], work dtype),
    no autograd: (O, lse); rows that see no key: O = 0, lse = -inf. `shape` is O's, for no parts."""
    if not parts:
        return (torch.zeros(shape, dtype=work, device=device),
                torch.full(shape[:3], float("-inf"), dtype=work, device=device))
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), 0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return sum(o * torch.exp(l - safe)[..., None] for o, l in parts), lse
