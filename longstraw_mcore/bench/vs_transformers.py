"""Side by side with `transformers` on one Qwen3.5-family model (the same weights, one process):

    hf_full     each branch a full P+R sequence with autograd (what TRL/verl-style trainers do); the
                gradient exact mode computes
    hf_cache    the prompt under no_grad once, each branch with autograd on a copy of its cache; the
                gradient detached mode computes
    detached    our capture + replay (replay/engine.py), one branch per micro-step (replay.batch_tokens=0)
    exact       our capture + replay + prompt backward, one branch per micro-step
    detached_batched, exact_batched   the same with the config's replay.batch_tokens (the default 8,192
                unless the config sets it: what a user gets): the branches in micro-steps of up to that
                many tokens against the one state, no copy of it (at R=128, G=8 all of them in one)

Each path runs the same GRPO terms and back-propagates them; its seconds (and ours per phase) are
timed, and its gradient is compared with its peer's (detached vs hf_cache, exact vs hf_full) so a fast
path that computes something else cannot look good. transformers runs its own CPU/GPU fast paths
(SDPA attention; flash-linear-attention's kernels where installed, its torch chunked rule otherwise).

`hf_full` at large P is the slowest by far: `copies` runs that many of the G identical-cost branches and
scales its seconds by G / copies (its gradient is then not compared).
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch

PATHS = ("hf_full", "hf_cache", "detached", "exact", "detached_batched", "exact_batched")


@contextlib.contextmanager
def assigning_linear_cache():
    """transformers' linear-attention cache writes a branch's new conv / recurrent state into the cached
    tensors in place, which autograd rejects once the old value is saved in the branch's graph; during
    branch forwards the two update methods assign the new tensor instead (the same values)."""
    from transformers.cache_utils import LinearAttentionLayer

    orig_conv, orig_rec = LinearAttentionLayer.update_conv_state, LinearAttentionLayer.update_recurrent_state

    def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kw):
        full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        self.conv_states[state_idx] = full[..., -self.conv_kernel_size[state_idx]:]
        return full

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kw):
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    LinearAttentionLayer.update_conv_state = update_conv_state
    LinearAttentionLayer.update_recurrent_state = update_recurrent_state
    try:
        yield
    finally:
        LinearAttentionLayer.update_conv_state, LinearAttentionLayer.update_recurrent_state = orig_conv, orig_rec


def build_hf(m, attn: str = "sdpa", seed: int = 0, fla: bool = False):
    """A randomly initialised `Qwen3_5ForCausalLM` of our config `m` (its own init), in m's dtype, running
    flash-linear-attention's Gated DeltaNet rule (`fla`) or its torch one (bench/hf_kernels.py)."""
    from transformers import Qwen3_5TextConfig

    from longstraw_mcore.bench.hf_kernels import qwen3_5_modeling
    from longstraw_mcore.checkpoint.qwen3_5 import hf_config_dict

    Qwen3_5ForCausalLM = qwen3_5_modeling(fla).Qwen3_5ForCausalLM
    if fla:  # the peer runs fla's rule as we do: on Hopper with Triton < 3.7.1, its backward at key dims > 64
        from longstraw_mcore.ops import fla_gdn  # (refused by fla otherwise, fla issue #640; ops/fla_gdn.py)

        fla_gdn.prepare()

    raw = hf_config_dict(m)
    for k in ("architectures", "model_type", "dtype"):
        raw.pop(k, None)
    cfg = Qwen3_5TextConfig(**raw)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(cfg).to(m.torch_dtype).eval()


def _logp(logits: torch.Tensor, resp: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(resp, device=logits.device)[:, None])[:, 0]


def hf_full(hf, prompt, responses, loss_fn) -> None:
    dev = hf.device
    for b, resp in enumerate(responses):
        logits = hf(input_ids=torch.tensor([prompt + resp[:-1]], device=dev), logits_to_keep=len(resp)).logits[0]
        loss, _ = loss_fn(b, _logp(logits, resp))
        loss.backward()


def hf_cache(hf, prompt, responses, loss_fn) -> float:
    """Returns the seconds of the no-grad prompt pass (the rest is the branches)."""
    from transformers import DynamicCache

    dev = hf.device
    t0 = time.perf_counter()
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        hf(input_ids=torch.tensor([prompt[:-1]], device=dev), past_key_values=cache, use_cache=True, logits_to_keep=1)
    _sync(dev)
    prompt_s = time.perf_counter() - t0
    for b, resp in enumerate(responses):
        c = copy.deepcopy(cache)
        with assigning_linear_cache():
            logits = hf(input_ids=torch.tensor([[prompt[-1]] + resp[:-1]], device=dev), past_key_values=c,
                        use_cache=True).logits[0]
        loss, _ = loss_fn(b, _logp(logits, resp))
        loss.backward()
    return prompt_s


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _grads_hf(hf) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for n, p in hf.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)  # ours may be on the GPU
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _worst(ours: dict, ref: dict) -> tuple[float, str]:
    """Largest relative difference over tensors (norms of the concatenations: one figure per path)."""
    keys = [k for k in ref if float(ref[k].double().norm()) > 0]
    worst = max(keys, key=lambda k: _rel(ours[k], ref[k]))
    return _rel(ours[worst], ref[worst]), worst


def _run_path(path, model, hf, m, group, rcfg, gcfg, fn, copies: int, keep_grads: bool = True):
    """One timed run of `path`: (seconds, phases, gradient in our naming, or None: not all branches
    run, or not `keep_grads`)."""
    from longstraw_mcore.checkpoint.full_state import gather_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.replay.group_step import process_group

    dev = next(model.parameters()).device
    G = len(group.responses)
    hf.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    _sync(dev)
    t0 = time.perf_counter()
    grads = None
    if path == "hf_full":
        n = copies if 0 < copies < G else G
        hf_full(hf, group.prompt, group.responses[:n], fn)
        _sync(dev)
        secs = (time.perf_counter() - t0) * G / n
        phases = {"branches": secs}
        if n == G and keep_grads:
            grads = hf_to_mcore(_grads_hf(hf), m)
    elif path == "hf_cache":
        pre = hf_cache(hf, group.prompt, group.responses, fn)
        _sync(dev)
        secs = time.perf_counter() - t0
        phases = {"prompt": pre, "branches": secs - pre}
        grads = hf_to_mcore(_grads_hf(hf), m) if keep_grads else None
    else:
        mode, batched = path.split("_")[0], path.endswith("_batched")
        r = type(rcfg)(**{**rcfg.__dict__, "mode": mode, "batch_tokens": rcfg.batch_tokens if batched else 0})
        st = process_group(model, group, r, gcfg)
        _sync(dev)
        secs = time.perf_counter() - t0
        phases = {k: v for k, v in st.seconds.items() if k != "total"}
        grads = gather_full(model, grads=True) if keep_grads else None
    return secs, phases, grads


def run_point(model, hf, m, group, rcfg, gcfg, paths=PATHS, copies: int = 0, warm: bool = True,
              progress=print) -> dict:
    """One (P, R, G) point: {path: {seconds, phases, cold_seconds, grad_rel_to_peer}}.

    warm: each path runs twice and the second run is timed (a training loop's steady state: the first
    run at a new size also pays the process's first touch of the memory its graphs take, ~2x our kept
    capture at P=16K on the CPU, where glibc keeps the freed heap for the next step); the first
    run's seconds are kept as `cold_seconds`."""
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn

    fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
    G = len(group.responses)
    out, grads = {}, {}
    for path in paths:
        cold = _run_path(path, model, hf, m, group, rcfg, gcfg, fn, copies, keep_grads=False)[0] if warm else None
        secs, phases, g = _run_path(path, model, hf, m, group, rcfg, gcfg, fn, copies)
        if g is not None:
            grads[path] = g
        out[path] = {"seconds": secs, "phases": phases}
        if cold is not None:
            out[path]["cold_seconds"] = cold
        if path == "hf_full" and copies and copies < G:
            out[path]["copies_run"] = copies
        progress(f"  {path:>16}: {secs:8.2f} s  " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
                 + (f"  (first run {cold:.2f} s)" if cold is not None else ""))
    for ours, peer in (("detached", "hf_cache"), ("exact", "hf_full"), ("detached_batched", "hf_cache"),
                       ("exact_batched", "hf_full")):
        if ours in grads and peer in grads:
            rel, worst = _worst(grads[ours], grads[peer])
            out[ours]["grad_rel_to_peer"] = {"peer": peer, "worst_rel": rel, "tensor": worst}
    return out


def load_same_weights(model, hf, m) -> None:
    """Our model gets the HF model's weights (the same numbers both sides)."""
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore

    load_full(model, hf_to_mcore({k: v.detach().clone() for k, v in hf.state_dict().items()}, m))


def gdn_kernels(m, T: int, repeats: int = 3, device="cpu") -> dict:
    """Gated DeltaNet's chunked rule alone, ours (ops/gated_delta.py) against transformers' torch one
    (`torch_chunk_gated_delta_rule`, what it runs without flash-linear-attention), on the same inputs of
    one layer of `m` over T tokens: tokens/s without autograd (capture) and forward + backward (replay,
    the exact sweep), best of `repeats`; and the outputs' largest difference."""
    import sys

    from longstraw_mcore.bench.hf_kernels import _MODULE, qwen3_5_modeling, torch_rule

    # transformers' own torch rule even where the process bound fla's (the name forwards to the binding)
    torch_chunk_gated_delta_rule = torch_rule(sys.modules.get(_MODULE) or qwen3_5_modeling(fla=False))

    from longstraw_mcore.ops.gated_delta import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    hk, hv, dk, dv = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    dt = m.torch_dtype
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dt)  # noqa: E731
    q, k, v = mk(1, T, hk, dk), mk(1, T, hk, dk), mk(1, T, hv, dv)
    gd = -torch.nn.functional.softplus(mk(1, T, hv)).float()
    beta = torch.sigmoid(mk(1, T, hv))
    C = m.gdn_chunk_size
    state_dtype = torch.float64 if dt == torch.float64 else torch.float32

    def ours(*x):
        return chunk_gated_delta_rule(*x, chunk_size=C, state_dtype=state_dtype)

    def theirs(q, k, v, gd, beta):  # (its l2 norm in the kernel, as the model calls it)
        # key heads repeated to the value heads first, as its model does before the call (transformers
        # 5.23's rule repeats them itself; 5.17's does not and fails on fewer key heads, seen on an H200)
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
        o, s = torch_chunk_gated_delta_rule(q, k, v, gd, beta, chunk_size=C, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
        return o, s

    out = {"T": T, "chunk": C}
    res = {}
    for name, fn in (("ours", ours), ("transformers", theirs)):
        best_f = best_b = float("inf")
        for _ in range(repeats):
            xs = [x.clone() for x in (q, k, v, gd, beta)]
            _sync(torch.device(device))
            t0 = time.perf_counter()
            with torch.no_grad():
                o, _ = fn(*xs)
            _sync(torch.device(device))
            best_f = min(best_f, time.perf_counter() - t0)
            xs = [x.clone().requires_grad_() for x in (q, k, v, gd, beta)]
            t0 = time.perf_counter()
            o2, s2 = fn(*xs)
            (o2.float().pow(2).sum() + s2.float().pow(2).sum()).backward()
            _sync(torch.device(device))
            best_b = min(best_b, time.perf_counter() - t0)
        res[name] = o.float()
        out[name] = {"forward_tokens_per_s": T / best_f, "forward_backward_tokens_per_s": T / best_b}
    out["max_abs_diff"] = float((res["ours"] - res["transformers"]).abs().max())
    return out
