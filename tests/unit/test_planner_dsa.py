"""The planner's GLM terms follow the DSA kernel that runs (ops.dsa: ops/kernel_choice.py dsa_kernel_name):
the plain-torch twins (ops/dsa.py) gather the selected latents [T, k, R + Dr] and form logits and
probabilities [T, h, k], and their indexer forms score blocks [T, block] per indexer head (and their
ReLU and weighted sum) beside a running best k; the MLA kernel (ops/dsa_triton_mla.py) forms none of
these, it keeps o_lat and a float32 lse [T, h]; the indexer kernel (ops/dsa_triton_indexer.py) forms the
weighted sum alone, the heads summed in registers, and selects as the twin does. The differences are derived here
from those shapes, at GLM-5.2's real dimensions in bf16; and the phases of a plan take the twin or the
kernel exactly where dsa_kernel_name says they run. All in this process, no ranks."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(path, *overrides):
    from longstraw_mcore.config import load_config

    return load_config(os.path.join(ROOT, path), list(overrides))


def test_glm_kinds_take_the_dsa_kernel_that_runs():
    from longstraw_mcore.families.glm_dsa import LAYERS

    ops = lambda c: _cfg("configs/glm-5.2.yaml", f"ops.dsa={c}").ops  # noqa: E731
    for kind in LAYERS.values():
        assert kind.kernel_name(ops("auto"), "cuda", "bfloat16") == "triton"
        assert kind.kernel_name(ops("auto"), "cuda", "float32") == "triton"
        assert kind.kernel_name(ops("auto"), "cuda", "float64") == "plain"   # the kernels take no float64
        assert kind.kernel_name(ops("auto"), "cpu", "bfloat16") == "plain"
        assert kind.kernel_name(ops("triton"), "cpu", "float32") == "triton"
        assert kind.kernel_name(ops("plain"), "cuda", "bfloat16") == "plain"


def test_kernel_path_has_no_score_blocks_or_gathered_latents():
    from longstraw_mcore.families.glm_dsa import LAYERS
    from longstraw_mcore.planner.activations import mla_backward_scratch, mla_bytes

    m = _cfg("configs/glm-5.2.yaml").model  # bf16: e = 2, the twins' work dtype float32
    e, w = 2, 4
    R, Dr, h, k, Hi, block = 512, 64, 64, 2048, 32, 4096
    assert (m.kv_lora_rank, m.qk_rope_head_dim, m.num_attention_heads, m.index_topk, m.index_n_heads,
            m.index_block) == (R, Dr, h, k, Hi, block)
    T, keys = 1024, 100_000
    full = LAYERS["mla_dsa_full"]

    # the indexer's moment: the twin's score blocks [T, block + k] per indexer head and their ReLU beside
    # the weighted sum (float32); the kernel sums the heads in registers and keeps the weighted sum alone.
    # Both keep the running best rows (int64, two copies)
    per_head = T * (block + k) * 2 * Hi * w
    assert full.capture_moment(m, T, keys, 1, "plain") - full.capture_moment(m, T, keys, 1, "triton") == per_head
    # neither grows with the keys past a block
    for kernel in ("triton", "plain"):
        assert full.capture_moment(m, T, 3 * keys, 1, kernel) == full.capture_moment(m, T, keys, 1, kernel)
    small = 1000  # fewer keys than a block and than k: the scores cover them all, k' = min(k, S)
    assert full.capture_moment(m, T, small, 1, "plain") - full.capture_moment(m, T, small, 1, "triton") \
        == T * (small + small) * 2 * Hi * w

    # the sparse MLA's saved tensors: the twin's selected latents and RoPE keys [T, k, R + Dr] (e), its
    # logits' softmax [T, h, k] in float32 and the cast (e); the kernel's lse [T, h] float32 instead
    # and the visible latents joined [keys, R + Dr] (e): the kernel reads the state's rows and the call's own
    # where they lie
    gathered, probs, lse, joined = T * k * (R + Dr) * e, T * h * k * (w + e), T * h * 4, keys * (R + Dr) * e
    assert mla_bytes(m, 1, T, keys) - mla_bytes(m, 1, T, keys, kernel="triton") == gathered + probs - lse + joined
    # the kernel takes no query blocks: memory.mla_query_block leaves its bytes as they are
    assert mla_bytes(m, 1, T, keys, 256, kernel="triton") == mla_bytes(m, 1, T, keys, kernel="triton")
    # per unit of top-k the kernel keeps only the indices (int64) and the validity (int8) of each query
    m2 = _cfg("configs/glm-5.2.yaml", "model.index_topk=1024").model
    assert mla_bytes(m, 1, T, keys, kernel="triton") - mla_bytes(m2, 1, T, keys, kernel="triton") == T * 1024 * 9
    assert mla_bytes(m, 1, T, keys) - mla_bytes(m2, 1, T, keys) == T * 1024 * (9 + (R + Dr) * e + h * (w + e))

    # the kernel's backward: dO_lat, dq in latent space and of the rotated q (e); float32 gradients of the
    # latents and RoPE keys that take one [keys, R], [keys, Dr] and their casts to e. The twin's: 0 here (the
    # planner counts its backward as a layer's saved tensors' worth)
    assert mla_backward_scratch(m, T, keys, 1, "triton") == T * h * (2 * R + Dr) * e + keys * (R + Dr) * (4 + e)
    assert mla_backward_scratch(m, T, keys, 1, "plain") == 0


def test_phases_follow_dsa_kernel_name():
    """The same kernel path gives the same phases wherever it runs: ops.dsa=triton planned for CPU against
    auto on CUDA (the kernels), auto on CPU against plain on CUDA (the twins); and the two differ."""
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.memory import phase_bytes

    fam = get_family("glm_dsa")
    base = ["model.num_layers=4", "model.dtype=bfloat16", "replay.mode=exact"]

    def phases(dsa, kernels):
        cfg = _cfg("configs/glm-5.2-tiny.yaml", *base, f"ops.dsa={dsa}")
        return phase_bytes(fam, cfg, 600, 64, 2, range(4), True, kernels)

    assert phases("triton", "cpu") == phases("auto", "cuda")
    assert phases("auto", "cpu") == phases("plain", "cuda")
    kernel, twin = phases("auto", "cuda"), phases("plain", "cuda")
    assert kernel["capture"] < twin["capture"] and kernel["prompt_backward"] < twin["prompt_backward"]


def test_checkpoint_rng_state_and_query_block_count():
    """What each torch.utils.checkpoint call keeps (the CPU generator's state) is torch's own size, and
    the twin's query blocks are ceil(T / B) checkpoints (none for one block, none for the kernel)."""
    import torch

    from longstraw_mcore.planner.activations import RNG_STATE_BYTES, mla_checkpoints

    assert RNG_STATE_BYTES == torch.get_rng_state().nbytes
    m = _cfg("configs/glm-5.2-tiny.yaml").model
    assert mla_checkpoints(m, 399, 16) == 25
    assert mla_checkpoints(m, 16, 16) == 0 and mla_checkpoints(m, 399, 0) == 0
    assert mla_checkpoints(m, 399, 16, "triton") == 0


def test_detached_replay_on_the_kernels_does_not_grow_with_the_prompt():
    """On the DSA kernels a detached replay reads the prompt state where it lies and makes gradients only
    for the branch's own rows: its phase bytes are the same at P = 20K and 40K (top-k 8 of the tiny config
    far below both); in exact mode the state's leaves take a gradient, so the replay grows with P. The
    twin joins the state's rows to the branch's (and its gather's backward is full size): it grows in both."""
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.memory import phase_bytes

    fam = get_family("glm_dsa")

    def replay(mode, dsa, P):
        cfg = _cfg("configs/glm-5.2-tiny.yaml", "model.num_layers=4", "model.dtype=bfloat16", f"replay.mode={mode}",
                   f"ops.dsa={dsa}")
        return phase_bytes(fam, cfg, P, 64, 2, range(4), True, "cuda")["replay"]

    assert replay("detached", "triton", 20_000) == replay("detached", "triton", 40_000)
    assert replay("exact", "triton", 20_000) < replay("exact", "triton", 40_000)
    assert replay("detached", "plain", 20_000) < replay("detached", "plain", 40_000)
