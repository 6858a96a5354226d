"""Build Hugging Face `Qwen3_5ForCausalLM` reference models for the tests (the implementation nobody
here wrote). Weights are perturbed away from HF's constant initialisations (zero norms, unit
dt_bias, ...) so that a wrong mapping or a swapped tensor cannot pass."""

from __future__ import annotations

import contextlib

import torch

from longstraw_mcore.checkpoint.qwen3_5 import hf_config_dict
from longstraw_mcore.config import Qwen35Config


def tiny_model_config(**overrides) -> Qwen35Config:
    base = dict(family="qwen3_5", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=4,
                full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                partial_rotary_factor=0.25, rope_theta=10000.0, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                gdn_chunk_size=8, dtype="float64")
    base.update(overrides)
    return Qwen35Config(**base)


def build_hf_model(m: Qwen35Config, seed: int = 0):
    from transformers import Qwen3_5TextConfig

    from longstraw_mcore.bench.hf_kernels import qwen3_5_modeling

    Qwen3_5ForCausalLM = qwen3_5_modeling(fla=False).Qwen3_5ForCausalLM  # its torch rule, never fla

    raw = hf_config_dict(m)
    raw.pop("architectures")
    raw.pop("model_type")
    raw.pop("dtype")
    cfg = Qwen3_5TextConfig(**raw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).to(m.torch_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Matrices already hold HF's random init (normal 0.02 / kaiming); vectors (norm weights,
            # A_log, dt_bias) start constant or nearly so: move them by ~0.1.
            scale = 0.1 if p.dim() == 1 else 0.01
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
            if name.endswith("A_log"):
                # HF draws A up to 16: with g = -A softplus(.) ~ -20 the state forgets everything each
                # token, decay-path gradients are ~1e-6 and no test could see a bug there. Keep A in
                # [0.05, 1]: memories of ~1-20 tokens, a decay path that matters.
                a = 0.05 + 0.95 * torch.rand(p.shape, generator=gen, dtype=torch.float64)
                p.copy_(a.log().to(p.dtype))
    model.eval()
    return model


class LiftFloat32ToFloat64(torch.overrides.TorchFunctionMode):
    """Run the reference with its float32 upcasts turned into float64 ones.

    The HF model computes RMSNorm statistics, the GDN decay and delta rule, the softmax and RoPE
    angles in float32 even when its weights are float64. Under this mode every dtype argument
    `torch.float32` becomes `torch.float64` and `Tensor.float()` becomes `.double()`: the same
    operations in the same order, only without the float32 rounding, so a float64 comparison
    measures the implementations, not float32 noise. Build *and* run the model under it (RoPE's
    inverse frequencies are computed at construction)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "float" and args and isinstance(args[0], torch.Tensor):
            return args[0].double()
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: (torch.float64 if v is torch.float32 else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def hf_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def recorded_topk_gaps():
    """Within the block, every DSA selection (ops/dsa.py `select_topk`, the pooled one's too) records the smallest
    gap between its k-th and (k+1)-th score over the queries that see more than k candidates: the list yielded.
    torch.topk (transformers') orders ties its own way and ours breaks them toward the earlier key, so a parity
    test must show a positive gap."""
    import longstraw_mcore.ops.dsa as D

    gaps, orig = [], D.select_topk

    def recording(scores, k):
        top = torch.sort(scores, -1, descending=True).values
        many = (scores > float("-inf")).sum(-1) > k
        if many.any():
            gaps.append(float((top[..., k - 1] - top[..., k])[many].min()))
        return orig(scores, k)

    D.select_topk = recording
    try:
        yield gaps
    finally:
        D.select_topk = orig


def hf_grads(model) -> dict:
    """A transformers model's parameter gradients by name (zeros where none arrived), and zeros for its routers'
    correction-bias buffers (GLM's `e_score_correction_bias`: no gradient), as the checkpoint tables read them."""
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    return grads
