"""Plain full-sequence GRPO: the reference branch replay is checked against (and the benchmark's
naive baseline). Each branch b runs the whole `[prompt, y_b]` with ordinary autograd (G copies of
the prompt), and its log-probs feed the same per-branch loss term; no prompt state is involved."""

from __future__ import annotations

import torch


def full_sequence_branches(model, prompt: list[int], responses: list[list[int]], loss_fn, logprob_chunk: int = 1024):
    core = getattr(model, "module", model)
    device = next(core.parameters()).device
    P = len(prompt)
    out = []
    for b, resp in enumerate(responses):
        ids = torch.tensor([prompt + resp[:-1]], device=device)
        hidden = model(ids, hidden_only=True)                       # [P+R-1, 1, Hd]
        tgt = torch.tensor([resp], device=device)
        logp = core.token_outputs(hidden[P - 1:], tgt, logprob_chunk)[0]
        if loss_fn is not None:
            loss, _ = loss_fn(b, logp)
            loss.backward()
        out.append(logp.detach())
    return out
