"""`peft` on `transformers` as the adapter reference (an implementation nobody here wrote): a random
non-zero LoRA on every default target, full-sequence autograd (exact mode's objective) and the cache
path (detached mode's; with the adapter disabled while the prompt cache is built for
adapter.prompt=frozen)."""

from __future__ import annotations

import contextlib
import copy

import torch

PREFIX = "base_model.model."


def random_peft(hf, targets: list[str] | str, r: int, alpha: float, seed: int):
    """`peft` LoRA on `targets` with A and B both random (B scaled to 0.1 of PEFT's non-zero init)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                          init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(torch.float64) * (0.1 if "lora_B" in n else 1.0)
    model.eval()
    return model


def lora_grads(peft_model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (dA, dB)} under the module's HF name."""
    out: dict[str, list] = {}
    for n, p in peft_model.named_parameters():
        if "lora_" not in n:
            continue
        mod, which = n[len(PREFIX):].split(".lora_")
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out.setdefault(mod, [None, None])[which.startswith("B")] = g.detach().clone()
    return {k: tuple(v) for k, v in out.items()}


def full_sequence(peft_model, group, loss_fn, lift):
    """Exact mode's reference: every branch as its own full sequence with autograd."""
    P, logps = len(group.prompt), []
    for b, resp in enumerate(group.responses):
        with lift():
            logits = peft_model(input_ids=torch.tensor([group.prompt + resp[:-1]])).logits[0, P - 1:]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        loss_fn(b, logp)[0].backward()
        logps.append(logp.detach())
    return logps


def cache_path(peft_model, group, loss_fn, lift, frozen_prompt: bool = False, also_off=contextlib.nullcontext):
    """Detached mode's reference: the prompt cache under no_grad (adapter off with `frozen_prompt`, and
    `also_off()` for adapters outside peft), each branch with autograd on a copy of it."""
    from test_detached_vs_hf_cache import _assigning_linear_cache
    from transformers import DynamicCache

    off = peft_model.disable_adapter() if frozen_prompt else contextlib.nullcontext()
    with lift(), torch.no_grad(), off, (also_off() if frozen_prompt else contextlib.nullcontext()):
        cache = DynamicCache(config=peft_model.config)
        peft_model(input_ids=torch.tensor([group.prompt[:-1]]), past_key_values=cache, use_cache=True)
    logps = []
    for b, resp in enumerate(group.responses):
        c = copy.deepcopy(cache)
        with lift(), _assigning_linear_cache():
            logits = peft_model(input_ids=torch.tensor([[group.prompt[-1]] + resp[:-1]]), past_key_values=c,
                                use_cache=True).logits[0]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        loss_fn(b, logp)[0].backward()
        logps.append(logp.detach())
    return logps


def worst(ours: dict, ref: dict) -> tuple[float, str]:
    """Largest relative difference over every adapter factor (relative to the factor's largest value)."""
    assert set(ours) == set(ref), sorted(set(ours) ^ set(ref))[:4]
    w, at = 0.0, ""
    for k in ref:
        for i, (a, b) in enumerate(zip(ours[k], ref[k])):
            d = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
            if d > w:
                w, at = d, f"{k}.lora_{'AB'[i]}"
    return w, at
