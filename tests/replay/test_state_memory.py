"""The prompt state holds what it says, measured with the profiler's memory timeline (CPU).

- After a capture, the bytes the capture allocated and kept equal the storage-true state bytes and
  the analytic formula exactly (both modes, two chunk sizes). A control with the old behaviour (the
  GDN conv window kept as a view into the chunk's padded input) keeps more: the test can fail.
- The capture's peak does not grow with the number of GDN layers x chunk size: from 1 to 5 GDN
  layers it grows by at most the extra state.
- Exact mode: the state gradient while branches replay is float32 (bf16 model) and its bytes equal
  the analytic formula; replaying a branch in exact mode needs no full-size [P, Hk, D] temporary on top
  of the detached replay (the attention backward adds dK/dV into the accumulators block by block).
Not covered: CUDA (the allocator's figures come from the same function on a GPU run)."""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


def _capture_worker(rank, world_size):
    from hf_reference import tiny_model_config

    from longstraw_mcore.bench.memory import measure_memory
    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.prompt_state import gdn
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes
    from longstraw_mcore.families import get_family
    from longstraw_mcore.replay.engine import capture

    out = {"capture": []}
    P = 129
    for layers in (2, 6):  # 1 and 5 GDN layers before one attention layer
        m = tiny_model_config(num_layers=layers, full_attention_interval=layers, dtype="float32", gdn_chunk_size=16)
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
        model = build_model(m, par, "cpu")
        prefix = torch.randint(0, m.vocab_size, (1, P - 1), generator=torch.Generator().manual_seed(0))
        for mode in ("detached", "exact"):
            for chunk in (32, 80):
                cfg = ReplayConfig(mode=mode, chunk_len=chunk)
                st, peak, kept, _ = measure_memory(lambda: capture(model, prefix, cfg), par.device)
                n_chunks = len(st.chunk_bounds) if mode == "exact" else 0
                out["capture"].append(dict(layers=layers, mode=mode, chunk=chunk, peak=peak, kept=kept,
                                           storage=st.nbytes(), analytic=sum(analytic_state_bytes(get_family(m.family).layers, m, 1, P - 1, n_chunks)
                                                                             .values())))
        if layers == 6:  # control: the old conv window, a view that pins the chunk's padded input
            real = gdn.own_storage
            gdn.own_storage = lambda t: t.detach()
            try:
                st, _, kept, _ = measure_memory(lambda: capture(model, prefix, ReplayConfig(chunk_len=80)), par.device)
            finally:
                gdn.own_storage = real
            out["control"] = dict(kept=kept, storage=st.nbytes(), analytic=sum(analytic_state_bytes(get_family(m.family).layers, m, 1, P - 1).values()))

    return out


def _grad_worker(rank, world_size):
    from hf_reference import tiny_model_config

    from longstraw_mcore.bench.memory import measure_memory
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.prompt_state.containers import analytic_state_grad_bytes
    from longstraw_mcore.families import get_family
    from longstraw_mcore.replay.engine import capture, make_leaves, replay_branches

    out = {"grad": {}}
    # exact-mode state gradient (bf16 model, blocks smaller than the prompt)
    m = tiny_model_config(num_layers=2, full_attention_interval=2, dtype="bfloat16", gdn_chunk_size=16,
                          attention_block=32)
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    model = build_model(m, par, "cpu")
    g = torch.Generator().manual_seed(1)
    P = 641
    prompt = torch.randint(0, m.vocab_size, (P,), generator=g).tolist()
    grp = RolloutGroup(prompt=prompt, responses=[torch.randint(0, m.vocab_size, (8,), generator=g).tolist()
                                                 for _ in range(2)], rewards=[0.0, 1.0])
    fn = group_loss_fn(grp, GRPOConfig(), advantages(grp.rewards, GRPOConfig()))
    for mode in ("detached", "exact"):
        st = capture(model, torch.tensor([prompt[:-1]]), ReplayConfig(mode=mode, chunk_len=256))
        if mode == "exact":
            make_leaves(st)
        replay_branches(model, st, prompt[-1], grp.responses, [0], fn, ReplayConfig(mode=mode))  # warm: .grad exist
        _, peak, _, _ = measure_memory(lambda: replay_branches(model, st, prompt[-1], grp.responses, [1], fn,
                                                               ReplayConfig(mode=mode)), par.device)
        out["grad"][mode] = dict(peak=peak, grad_bytes=st.grad_nbytes(),
                                 analytic=analytic_state_grad_bytes(get_family(m.family).layers, m, 1, P - 1),
                                 dtypes=sorted({str(t.dtype) for s in st.layers.values() for t in s.grad_tensors()}))
    hk, d = m.num_key_value_heads, m.head_dim
    out["one_layer_kv_f32"] = 2 * (P - 1) * hk * d * 4
    return out


def test_state_bytes_are_storage_true_and_capture_peak_does_not_grow():
    out = run_ranks(_capture_worker, 1, timeout_s=600)[0]
    for r in out["capture"]:
        print(f"capture {r['layers']} layers {r['mode']:>8} chunk {r['chunk']:>3}: peak {r['peak']} B, kept {r['kept']} B, "
              f"state storage {r['storage']} B, analytic {r['analytic']} B")
        assert r["kept"] == r["storage"] == r["analytic"], r
    for mode in ("detached", "exact"):
        for chunk in (32, 80):
            a, b = (next(r for r in out["capture"] if (r["layers"], r["mode"], r["chunk"]) == (n, mode, chunk))
                    for n in (2, 6))
            growth = b["peak"] - a["peak"]
            print(f"{mode} chunk {chunk}: peak +{growth} B from 1 to 5 GDN layers, state +{b['analytic'] - a['analytic']} B")
            # at most the extra state (less when the peak comes before the last chunk's state exists)
            assert growth <= b["analytic"] - a["analytic"] + 1024, (mode, chunk, growth)
    c = out["control"]
    print(f"control (conv window kept as a view): kept {c['kept']} B vs analytic {c['analytic']} B")
    assert c["kept"] > c["analytic"] + 4 * 80 * 4  # the pinned padded inputs show


def test_exact_state_gradient_float32_and_no_full_size_temporary():
    out = run_ranks(_grad_worker, 1, timeout_s=600)[0]
    ex, de = out["grad"]["exact"], out["grad"]["detached"]
    print(f"exact: state gradient {ex['grad_bytes']} B (analytic {ex['analytic']} B, {ex['dtypes']}); replaying one "
          f"branch peaks at {ex['peak']} B vs {de['peak']} B detached (one layer's K/V in float32: "
          f"{out['one_layer_kv_f32']} B)")
    assert ex["grad_bytes"] == ex["analytic"] and ex["dtypes"] == ["torch.float32"]
    assert de["grad_bytes"] == 0
    assert ex["peak"] - de["peak"] < out["one_layer_kv_f32"] // 2
