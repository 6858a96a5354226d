"""A vocabulary that TP does not divide (97) is padded as Megatron pads it, and nothing depends on it.

Two gloo ranks, float64, `make_vocab_size_divisible_by=8`: V_pad = 104 at TP=1, 112 at TP=2 (97 is
prime, so every layout pads). Checked against `transformers` (its float32 upcasts lifted to float64)
and across layouts, all to <= 1e-10:
- logits (padding trimmed) and the gradient of every parameter (true vocabulary) at TP=1 and TP=2
  equal the reference; the padded rows of the embedding and output layer get exactly zero gradient;
- branch replay (detached and exact) at TP=2 gives the TP=1 loss, log-probs and gradients;
- loading the HF directory at TP=2 reads only each rank's rows/columns of every tensor (the byte
  count of the safetensors slices equals the rank's true, unpadded shard);
- a checkpoint saved at TP=2 (V_pad 112) loads at TP=1 (V_pad 104) with identical logits, and a
  Megatron->HF conversion of it carries 97 rows.
"""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def _worker(rank, world_size, tmpdir):
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))
    from hf_reference import LiftFloat32ToFloat64, build_hf_model, hf_state, tiny_model_config
    from test_replay_equivalence import grads_and_loss, make_group

    from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint, save_checkpoint
    from longstraw_mcore.checkpoint.full_state import _entries, _leaves, _slices, _true_rows, gather_full
    from longstraw_mcore.checkpoint.hf import SafetensorsDir
    from longstraw_mcore.checkpoint.qwen3_5 import LazyCanonical, hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.models.language_model import gather_vocab
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import run_group

    m = tiny_model_config(vocab_size=97, make_vocab_size_divisible_by=8)
    with LiftFloat32ToFloat64():
        hf = build_hf_model(m, seed=21)
    hf_dir = Path(tmpdir) / "hf"
    if rank == 0:
        hf.save_pretrained(hf_dir)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (2, 19), generator=gen)
    probe = torch.randn(2, 19, 97, generator=gen, dtype=torch.float64)
    with LiftFloat32ToFloat64():
        ref_logits = hf(input_ids=ids).logits
    (ref_logits * probe).sum().backward()
    ref_grads = hf_to_mcore({n: p.grad for n, p in hf.named_parameters()}, m)
    group = make_group(m, 17, [5, 2, 6], seed=8)
    out = {}
    for tp in (1, 2):
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=tp), device="cpu"))
        model = build_model(m, par, "cpu")
        torch.distributed.barrier()
        src = SafetensorsDir(hf_dir)
        from longstraw_mcore.checkpoint.full_state import load_full

        load_full(model, LazyCanonical(src, m))
        expected = 0
        for e in _entries(model):
            for leaf in _leaves(e)[0]:
                sl, rows = _slices(leaf), _true_rows(model, leaf)
                n = [s.stop - s.start for s in sl]
                if rows is not None:
                    n[0] = max(0, min(sl[0].stop, rows) - sl[0].start)
                expected += int(torch.tensor(n).prod()) * 8
        logits = gather_vocab(model(ids), par.pgs.tp, vocab_size=97)
        (logits * probe).sum().backward()
        grads = gather_full(model, grads=True)
        pad = [p.grad[p.grad.shape[0] - (model.padded_vocab_size - 97):] if par.tp_rank == tp - 1 else p.grad[:0]
               for p in (model.embedding.word_embeddings.weight, model.output_layer.weight)]
        res = dict(v_pad=model.padded_vocab_size, logits=rel(logits, ref_logits),
                   grad=max(rel(grads[k], ref_grads[k]) for k in ref_grads), pad_grad_zero=all(bool((x == 0).all())
                                                                                             for x in pad),
                   read=src.bytes_read, expected_read=expected)
        for mode in ("detached", "exact"):
            cfg = ReplayConfig(mode=mode, chunk_len=6)
            res[mode] = grads_and_loss(model, group, GRPOConfig(beta=0.05), lambda fn: [
                r.logprobs for r in run_group(model, group.prompt, group.responses, fn, cfg)[0]])
        if tp == 1:
            tp1_logits = logits.detach()
        if tp == 2:
            save_checkpoint(model, Path(tmpdir) / "ckpt", m, par.layout())
        out[tp] = res
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=1), device="cpu"))
    model = build_model(m, par, "cpu")
    load_checkpoint(model, Path(tmpdir) / "ckpt")
    reloaded = gather_vocab(model(ids), par.pgs.tp, vocab_size=97).detach()
    out["reload_equal"] = torch.equal(reloaded, tp1_logits)  # the same weights at the same layout
    out["lm_head"] = hf_state(hf)["lm_head.weight"]
    for tp in (1, 2):
        for mode in ("detached", "exact"):
            l, lp, g = out[tp][mode]
            out[tp][mode] = (l, [x.tolist() for x in lp], g)
    return out


def test_padded_vocabulary_tp2_equals_tp1_equals_transformers(tmp_path):
    outs = run_ranks(_worker, 2, str(tmp_path), timeout_s=600)
    for rank, out in enumerate(outs):
        for tp in (1, 2):
            r = out[tp]
            if rank == 0:
                print(f"TP={tp}: V_pad {r['v_pad']}, logits vs transformers {r['logits']:.1e}, worst grad "
                      f"{r['grad']:.1e}, HF bytes read {r['read']} (its shard: {r['expected_read']})")
            assert r["v_pad"] == {1: 104, 2: 112}[tp]
            assert r["logits"] <= 1e-10 and r["grad"] <= 1e-10 and r["pad_grad_zero"], (tp, r)
            assert r["read"] == r["expected_read"], (tp, rank, r["read"], r["expected_read"])
        for mode in ("detached", "exact"):
            (l1, lp1, g1), (l2, lp2, g2) = out[1][mode], out[2][mode]
            worst = max(rel(g2[k], g1[k]) for k in g1)
            lp = max(abs(a - b) for x, y in zip(lp1, lp2) for a, b in zip(x, y))
            if rank == 0:
                print(f"replay {mode}: TP=2 vs TP=1 loss {abs(l1 - l2) / abs(l1):.1e}, logp {lp:.1e}, grad {worst:.1e}")
            assert abs(l1 - l2) <= 1e-10 * abs(l1) and lp <= 1e-10 and worst <= 1e-10, mode
        assert out["reload_equal"]
    # Megatron -> HF with the converter (a one-process tool): the padding does not come back
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "mcore-to-hf", str(tmp_path / "ckpt"),
                        str(tmp_path / "back")], cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back["model.embed_tokens.weight"].shape[0] == back["lm_head.weight"].shape[0] == 97
    assert torch.equal(back["lm_head.weight"], outs[0]["lm_head"])
    assert outs[0][2]["read"] < outs[0][1]["read"]  # a TP=2 rank reads less than the whole model
