"""Model chunks through Megatron's interleaved schedule (parallel.vpp: models/language_model.py's `vp_stage`,
replay/pipeline.schedule), float64 on gloo, against one rank: a next-token loss over micro-batches of
different lengths (variable_seq_lengths: shapes exchanged per micro-batch), the loss of every micro-batch
and every gradient (under the checkpoint's global names) equal to one rank's (<= 1e-12 relative), and the
forward-only schedule's losses too. Layouts: PP=2 x VPP=2 (a stage's previous and next rank are one peer:
the shape exchange of parallel/p2p_shapes.py; Megatron 0.19.2's own crossed the shapes and failed),
PP=2 x VPP=2 with an uneven split of virtual stages, PP=4 x VPP=2. The weights come from one Hugging Face
directory through the checkpoint converter (the chunks' layers numbered globally). The replay plan does not
run through chunks yet: every command refuses parallel.vpp > 1 (tests/dist/test_cli_errors.py)."""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks

LENS = (9, 5, 12, 7, 3, 11, 6, 4)


def _ranks(rank, world, hf, pp, vpp, pp_layers, forward_only):
    from longstraw_mcore.checkpoint.convert import load_hf_into_model
    from longstraw_mcore.checkpoint.full_state import _pieces
    from longstraw_mcore.config import ParallelConfig, RunConfig
    from longstraw_mcore.families import get_family, read_hf_config
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.pipeline import schedule

    m, _ = read_hf_config(hf)
    cfg = RunConfig(model=m, parallel=ParallelConfig(pp=pp, vpp=vpp, pp_layers=pp_layers), device="cpu")
    par = setup_parallel(cfg)
    fam = get_family(m.family)
    chunks = [fam.build_model(m, par, "cpu", vp_stage=v if vpp > 1 else None) for v in range(vpp)]
    for c in chunks:
        load_hf_into_model(fam, c, hf, expect=m)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, m.vocab_size, (1, n), generator=gen) for n in LENS]

    def loss_of(logits, ids):
        lp = logits[..., :m.vocab_size].double().log_softmax(-1)
        return -lp[0, :-1].gather(-1, ids[0, 1:, None]).mean()

    if world == 1:
        losses = []
        for ids in seqs:
            loss = loss_of(chunks[0](ids), ids)
            if not forward_only:
                loss.backward()
            losses.append(float(loss))
    else:
        losses = {}

        def forward_step(data_iterator, chunk):
            i = next(data_iterator)
            out = chunk(seqs[i] if chunk.pre_process else None)

            def loss_fn(logits):
                loss = loss_of(logits, seqs[i])
                losses[i] = float(loss)
                return loss * len(seqs), torch.ones((), dtype=torch.int), {}  # (Megatron divides by the count)

            return out, loss_fn

        data = list(range(len(seqs)))
        schedule(chunks if vpp > 1 else chunks[0], par.pgs, chunks[0].config, data, forward_step, forward_only)
        losses = [losses[i] for i in sorted(losses)]
    grads = {} if forward_only else {key: t.clone() for c in chunks for key, _, _, t in _pieces(c, True, False)}
    layers = [[layer.layer_number - 1 for layer in c.decoder.layers] for c in chunks]
    return losses, grads, layers


def test_interleaved_chunks_equal_one_rank(tmp_path):
    from hf_reference import build_hf_model, tiny_model_config

    hf = tmp_path / "hf"
    build_hf_model(tiny_model_config(num_layers=8), seed=3).save_pretrained(hf)
    one_losses, one_grads, _ = run_ranks(_ranks, 1, str(hf), 1, 1, None, False)[0]
    for pp, vpp, split in ((2, 2, None), (2, 2, [1, 3, 2, 2]), (4, 2, None)):
        ranks = run_ranks(_ranks, pp, str(hf), pp, vpp, split, False)
        losses = next(r[0] for r in ranks if r[0])  # (the last rank's)
        grads = {k: g for r in ranks for k, g in r[1].items()}
        layers = sorted(x for r in ranks for chunk in r[2] for x in chunk)
        worst = max(float((grads[k] - one_grads[k]).abs().max() / one_grads[k].abs().max()) for k in one_grads)
        loss = max(abs(a - b) for a, b in zip(losses, one_losses))
        print(f"PP={pp} x VPP={vpp} split {split}: chunks' layers {[r[2] for r in ranks]}; loss {loss:.1e}, "
              f"gradients {worst:.1e} of each tensor's largest entry")
        assert layers == list(range(8)) and set(grads) == set(one_grads), sorted(set(grads) ^ set(one_grads))[:4]
        assert len(losses) == len(LENS) and loss <= 1e-12 and worst <= 1e-12
        if split is not None:
            assert [r[2] for r in ranks] == [[[0], [4, 5]], [[1, 2, 3], [6, 7]]]  # virtual stage v x pp + r
    fwd = run_ranks(_ranks, 2, str(hf), 2, 2, None, True)  # (forward-only: the capture's schedule)
    fwd_losses = next(r[0] for r in fwd if r[0])
    assert max(abs(a - b) for a, b in zip(fwd_losses, one_losses)) <= 1e-12
