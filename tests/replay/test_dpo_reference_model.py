"""DPO uses a reference model when one is given and the rollouts carry no ref_logprobs: its margin
comes from a no-grad replay of the reference policy, and the loss and gradients equal those of the
same group with the reference's full-sequence log-probs written into the rollouts (float64, exact
mode). A reference model nothing would use is refused before any work (tests/dist/test_cli_errors.py)."""

from __future__ import annotations

from longstraw_mcore.launch_local import run_ranks


def _worker(rank, world_size):
    from hf_reference import build_hf_model, hf_state, tiny_model_config
    from test_replay_equivalence import make_group, rel

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.replay.reference import full_sequence_branches

    m = tiny_model_config()
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    policy, ref = build_model(m, par, "cpu"), build_model(m, par, "cpu")
    load_full(policy, hf_to_mcore(hf_state(build_hf_model(m, seed=31)), m))
    load_full(ref, hf_to_mcore(hf_state(build_hf_model(m, seed=32)), m))
    group = make_group(m, 19, [5, 3], seed=33)
    group.rewards, group.old_logprobs, group.ref_logprobs = [0.1, 0.7], None, None
    gcfg, rcfg = GRPOConfig(objective="dpo", beta=0.5), ReplayConfig(mode="exact", chunk_len=6)
    policy.zero_grad(set_to_none=True)
    with_model = process_group(policy, group, rcfg, gcfg, ref_model=ref)
    g_model = gather_full(policy, grads=True)
    group.ref_logprobs = [lp.tolist() for lp in full_sequence_branches(ref, group.prompt, group.responses, None)]
    policy.zero_grad(set_to_none=True)
    with_file = process_group(policy, group, rcfg, gcfg)
    g_file = gather_full(policy, grads=True)
    group.ref_logprobs = None
    policy.zero_grad(set_to_none=True)
    without = process_group(policy, group, rcfg, gcfg)  # reference-free DPO: a different loss
    return dict(loss=abs(with_model.loss - with_file.loss) / abs(with_file.loss),
                grad=max(rel(g_model[k], g_file[k]) for k in g_file), ref_state=with_model.ref_state_bytes,
                free_loss_differs=abs(without.loss - with_file.loss) > 1e-6)


def test_dpo_scores_the_reference_model():
    r = run_ranks(_worker, 1, timeout_s=600)[0]
    print(f"DPO with a reference model vs its log-probs in the rollouts: loss {r['loss']:.1e}, worst grad "
          f"{r['grad']:.1e}, reference state {r['ref_state']} B")
    assert r["loss"] <= 1e-12 and r["grad"] <= 1e-10 and r["ref_state"] > 0 and r["free_loss_differs"]
