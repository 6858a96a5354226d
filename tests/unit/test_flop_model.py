"""The analytic FLOP model (planner/flops.py) equals what torch.utils.flop_counter.FlopCounterMode counts on the
real code path (attention on the plain twin), FLOP for FLOP: branch replay in both modes, with the attention
probabilities recomputed or stored, naive full-sequence GRPO, at TP=1 and TP=2 (per rank), for prompt/branch
lengths that are not multiples of the attention block, the GDN chunk or the capture chunk, a one-token branch
and a one-token prompt, and a prefix tree of depth 2 (replay/tree.py, both modes: its segments' keys and GDN
state read with gradients, their final GDN state seeded). GLM-5.x (planner/flops_mla.py) likewise at TP=1 and
TP=2 (per rank), on the tiny GLM config at 4 layers (full and shared indexer layers, dense and MoE MLPs): both
modes and naive, keys past the top-k and past an indexer block, a one-token prompt; GLM-5.3-Flash
(planner/flops_glm5_next.py: KDA, pooled MLA + DSA, hyper-connections) the same way. The benchmark's "measured /
minimum" ratios and `longstraw plan`'s FLOPs rest on this model, so it must be exact, not close.

Every replay row runs at replay.batch_tokens=0 (one branch per micro-step) and at a budget that puts
branches of different lengths in one right-padded micro-step (flat: 40 and 21 tokens together, 1 alone;
the tree: each node's tails of 7 and 2 / 3 tokens together), so the padded positions are counted
(planner/flops.py `padded_steps`). Not covered: expert parallelism's lockstep lengths (replay/engine.py
`_flat_lengths` pads to the longest over the EP group's groups), which the model does not follow.

At TP=1 the two ranks are data-parallel replicas (the same weights, the same inputs: the same counts), so
they take the TP=1 rows in turn (`_turns`) and each returns the rows it counted; at TP=2 both ranks run
every row (its collectives need both) and rank 0's counts are kept."""

from __future__ import annotations

import itertools

from longstraw_mcore.launch_local import run_ranks


def _turns(rank: int, world_size: int):
    """`share(tp)` -> (run the row on this rank, keep its count): at TP=1 (data-parallel replicas) each
    row on one rank, in turn; at TP>1 every row on every rank, rank 0's count kept."""
    turn = itertools.count()

    def share(tp: int) -> tuple[bool, bool]:
        if tp > 1:
            return True, rank == 0
        mine = next(turn) % world_size == rank
        return mine, mine
    return share


def _tree_rows(model, family, m, prompt, lengths, g, chunk: int, logprob_chunk: int, tp: int, share):
    """[(mode, batch_tokens, FlopCounterMode's count, the analytic count)] of a depth-2 prefix tree (widths
    1, 2, 2, segments of `lengths`; responses 1 and 3 cut to tails of 2 and 3 tokens) after `prompt`, both
    modes, one tail per micro-step and each node's two tails in one padded micro-step (replay/tree.py;
    the FLOP model's pieces); the rows `share` (`_turns`) gives this rank."""
    from torch.utils.flop_counter import FlopCounterMode

    from longstraw_mcore.bench.trees import full_tree
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.planner.flops import step_flops
    from longstraw_mcore.replay.engine import replay_pieces
    from longstraw_mcore.replay.group_step import process_group

    cut = (0, lengths[-1] - 2, 0, lengths[-1] - 3)
    resp = [r[:len(r) - c] for r, c in zip(full_tree(m.vocab_size, (1, 2, 2), lengths, g), cut)]
    tree = RolloutGroup(prompt=prompt, responses=resp, rewards=[0.0, 1.0, 2.0, 0.5])
    out = []
    for mode in ("detached", "exact"):
        for bt in (0, 2 * lengths[-1]):
            run, keep = share(tp)
            if not run:
                continue
            rc = ReplayConfig(mode=mode, chunk_len=chunk, logprob_chunk=logprob_chunk, batch_tokens=bt)
            model.zero_grad(set_to_none=True)
            with FlopCounterMode(display=False) as fc:
                process_group(model, tree, rc, GRPOConfig())
            an = step_flops(family.layers, m, len(prompt), replay_pieces(model, tree.responses, rc), mode, chunk, tp,
                            batch_tokens=bt)
            if keep:
                out.append((f"{mode} tree", bt, fc.get_total_flops(), an["algorithm"]["total"]))
    return out


def _worker(rank, world_size):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from longstraw_mcore.config import OpsConfig
    from longstraw_mcore.ops.dispatch import configure

    # The model counts the plain twin's attention (whole key blocks); FlopCounterMode has no formula for
    # torch's fused CPU attention op, which ops.attention=auto takes on CPU.
    configure(OpsConfig(attention="plain"))

    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig, load_config
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.loss.grpo import GRPOConfig, advantages, group_loss_fn
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.planner.flops import naive_flops, step_flops
    from longstraw_mcore.families import get_family
    from longstraw_mcore.replay.engine import stores_attention_probs
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.replay.plan import micro_steps
    from longstraw_mcore.replay.reference import full_sequence_branches

    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    m = load_config(os.path.join(root, "configs", "qwen3.6-tiny.yaml"), ["model.attention_block=32"]).model
    gcfg = GRPOConfig()
    rows, groups, share = [], {}, _turns(rank, world_size)
    g = torch.Generator().manual_seed(0)
    for tp in (1, 2):
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=tp), device="cpu"))
        model = build_model(m, par, "cpu")
        for P, lens in ((140, [40, 21, 1]), (1, [33, 5])):
            prompt = torch.randint(0, m.vocab_size, (P,), generator=g).tolist()
            resp = [torch.randint(0, m.vocab_size, (n,), generator=g).tolist() for n in lens]
            group = RolloutGroup(prompt=prompt, responses=resp, rewards=[float(i) for i in range(len(lens))])
            groups[P] = group
            for mode in ("detached", "exact"):
                for budget in ((0.0, 64.0) if P > 1 else (0.0,)):  # a 1-token prompt has nothing to store
                    # batch_tokens 80: P=140's 40 and 21 in one micro-step (2 x 40), 1 alone; P=1's 33 and 5 (2 x 33)
                    for bt in (0, 80):
                        rc = ReplayConfig(mode=mode, chunk_len=128, attn_probs_budget_mib=budget, logprob_chunk=32,
                                          batch_tokens=bt)
                        # decided per micro-step, on its padded batch
                        store = {stores_attention_probs(model, P - 1, rc, b - a, max(lens[a:b]))
                                 for a, b in micro_steps(lens, bt)}
                        assert len(store) == 1
                        store = store.pop()
                        run, keep = share(tp)
                        if not run:
                            continue
                        model.zero_grad(set_to_none=True)
                        with FlopCounterMode(display=False) as fc:
                            process_group(model, group, rc, gcfg)
                        an = step_flops(get_family(m.family).layers, m, P, lens, mode, 128, tp, store_probs=store,
                                        batch_tokens=bt)
                        if keep:
                            rows.append((tp, P, mode, budget, bt, store, fc.get_total_flops(),
                                         an["algorithm"]["total"]))
            run, keep = share(tp)
            if run:
                fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
                with FlopCounterMode(display=False) as fc:
                    full_sequence_branches(model, prompt, resp, fn, 32)
            if keep:
                rows.append((tp, P, "naive", 0.0, 0, False, fc.get_total_flops(),
                             naive_flops(get_family(m.family).layers, m, P, lens, tp)["algorithm"]))
        # a prefix tree (replay/tree.py): its pieces after their paths' segments
        for mode, bt, measured, analytic in _tree_rows(model, get_family(m.family), m, groups[140].prompt, (9, 5, 7),
                                                       g, 128, 32, tp, share):
            rows.append((tp, 140, mode, 0.0, bt, False, measured, analytic))
        # the budget is a threshold on the bytes: one byte short of a branch's probabilities = recompute
        heads = m.num_attention_heads // tp * m.layer_types.count("full_attention")
        need = heads * 40 * 139 * 4
        at = ReplayConfig(attn_probs_budget_mib=need / 2**20)
        below = ReplayConfig(attn_probs_budget_mib=(need - 1) / 2**20)
        if rank == 0:
            rows.append((tp, "threshold", stores_attention_probs(model, 139, at, 1, 40),
                         stores_attention_probs(model, 139, below, 1, 40)))
    # a model whose last layer is Gated DeltaNet (G G G A G G G): exact mode's recompute then stops
    # after that layer's state and leaves its output path out of the backward
    m7 = load_config(os.path.join(root, "configs", "qwen3.6-tiny.yaml"),
                     ["model.attention_block=32", "model.num_layers=7"]).model
    par = setup_parallel(RunConfig(model=m7, parallel=ParallelConfig(tp=2), device="cpu"))
    model = build_model(m7, par, "cpu")
    group = groups[140]
    for mode in ("detached", "exact"):
        rc = ReplayConfig(mode=mode, chunk_len=128, logprob_chunk=32, batch_tokens=80)
        with FlopCounterMode(display=False) as fc:
            process_group(model, group, rc, gcfg)
        if rank == 0:
            an = step_flops(get_family(m7.family).layers, m7, len(group.prompt), [len(r) for r in group.responses],
                            mode, 128, 2, batch_tokens=80)
            rows.append(("gdn-last", 140, mode, 0.0, 80, False, fc.get_total_flops(), an["algorithm"]["total"]))
    # GLM-5.3-Flash (lite: no one-token prompt, at TP=2 detached at one token budget and no tree: the padding, the
    # tree and the one-token prompt are family-neutral code, held by the other two families' rows)
    return {"qwen": rows, "glm": _glm_rows(root, share), "glm5": _glm_rows(root, share, _glm5_tiny(root), lite=True)}


def _glm5_tiny(root):
    """GLM-5.3-Flash-tiny at 4 layers: KDA / MLA full / MLA shared / KDA (the model's last layer a KDA layer, its
    capture and recompute only as far as its state), dense, dense, MoE, MoE; pools of 4, index_topk 8 (two pools)."""
    import dataclasses
    import os

    from longstraw_mcore.config import load_config

    m = load_config(os.path.join(root, "configs", "glm5.3-flash-tiny.yaml"), ["model.index_block=5"]).model
    return dataclasses.replace(m, num_layers=4, mixer_types=["linear_attention", "indexed_attention",
                                                             "indexed_attention", "linear_attention"],
                               indexer_types=["full", "full", "shared", "full"],
                               mlp_layer_types=["dense", "dense", "sparse", "sparse"])


def _glm_rows(root, share, m=None, lite: bool = False):
    """GLM-5.2-tiny at 4 layers (indexer full on 0, 1, 2, shared on 3; dense 0-2, MoE 3) at TP=1 and TP=2
    (per rank: the latent striped over TP, every head's queries gathered onto each stripe, the MoE tokens
    split by sequence): index_block=5 and index_topk=8 below the keys a query sees, chunks of 12 over a
    30-token prompt, branches of 1 and 6 tokens; a one-token prompt at TP=1 (branches of 5 and 2); one
    branch per micro-step and (batch_tokens 12) both in one padded micro-step. The rows `share` gives
    this rank (`_turns`)."""
    import os

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig, load_config
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families import get_family
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.planner.flops import naive_flops, step_flops
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.replay.reference import full_sequence_branches

    m = m or load_config(os.path.join(root, "configs", "glm-5.2-tiny.yaml"),
                         ["model.num_layers=4", "model.index_block=5"]).model
    family = get_family(m.family)
    g, gcfg, rows = torch.Generator().manual_seed(1), GRPOConfig(), []
    cases = [(P, [torch.randint(0, m.vocab_size, (n,), generator=g).tolist() for n in lens],
              torch.randint(0, m.vocab_size, (P,), generator=g).tolist()) for P, lens in ((30, [1, 6]), (1, [5, 2]))]
    for tp in (1, 2):
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=tp), device="cpu"))
        model = family.build_model(m, par, "cpu")
        for P, resp, prompt in cases if tp == 1 and not lite else cases[:1]:
            lens = [len(r) for r in resp]
            group = RolloutGroup(prompt=prompt, responses=resp, rewards=[float(i) for i in range(len(lens))])
            for mode in ("detached", "exact") if not (lite and tp > 1) else ("detached",):
                for bt in (0, 12) if not (lite and tp > 1) else (0,):
                    run, keep = share(tp)
                    if not run:
                        continue
                    model.zero_grad(set_to_none=True)
                    with FlopCounterMode(display=False) as fc:
                        process_group(model, group, ReplayConfig(mode=mode, chunk_len=12, logprob_chunk=4,
                                                                 batch_tokens=bt), gcfg)
                    if keep:
                        rows.append((tp, P, mode, bt, fc.get_total_flops(),
                                     step_flops(family.layers, m, P, lens, mode, 12, tp,
                                                batch_tokens=bt)["algorithm"]["total"]))
            run, keep = share(tp)
            if run:
                fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
                with FlopCounterMode(display=False) as fc:
                    full_sequence_branches(model, prompt, resp, fn, 4)
            if keep:
                rows.append((tp, P, "naive", 0, fc.get_total_flops(),
                             naive_flops(family.layers, m, P, lens, tp)["algorithm"]))
            # a prefix tree: its segments' latents read by their children (replicated over TP)
            if P == 30 and not (lite and tp > 1):
                rows += [(tp, P, mode, bt, measured, analytic) for mode, bt, measured, analytic
                         in _tree_rows(model, family, m, prompt, (4, 3, 5), g, 12, 4, tp, share)]
    return rows


def test_flop_model_equals_flop_counter():
    per_rank = run_ranks(_worker, 2, timeout_s=600)
    # the TP=1 rows from the rank that counted each, the TP=2 rows from rank 0 (the largest TP rank)
    res = {k: [r for x in per_rank for r in x[k]] for k in ("qwen", "glm", "glm5")}
    rows = res["qwen"]
    thresholds = [r for r in rows if r[1] == "threshold"]
    counts = [r for r in rows if r[1] != "threshold"]
    for tp, P, mode, budget, bt, store, measured, analytic in counts:
        print(f"tp={tp} P={P} {mode:>13} store={store!s:>5} batch_tokens={bt:>2}: FlopCounterMode {measured:,} "
              f"analytic {analytic:,.0f}")
    # per tp: P=140 (2 modes x 2 probability budgets x 2 token budgets + naive), P=1 (2 x 2 + naive), a
    # prefix tree (2 modes x 2 token budgets); the GDN-last model (2 modes)
    assert len(counts) == 2 * ((8 + 1) + (4 + 1) + 4) + 2
    for tp, P, mode, budget, bt, store, measured, analytic in counts:
        assert measured == analytic, (tp, P, mode, store, bt, measured, analytic)
        assert store == (budget > 0 and P > 1 and not mode.startswith("naive") and "tree" not in mode)
    by = {(tp, P, mode, bt, store): measured for tp, P, mode, _, bt, store, measured, _ in counts}
    for tp in (1, 2):
        for mode in ("detached", "exact"):
            for bt in (0, 80):  # storing the probabilities removes exactly the score recompute: fewer FLOPs
                assert by[(tp, 140, mode, bt, True)] < by[(tp, 140, mode, bt, False)]
            # the padded micro-step does more work than its branches alone (21 tokens run as 40)
            assert by[(tp, 140, mode, 80, False)] > by[(tp, 140, mode, 0, False)]
            assert by[(tp, 140, f"{mode} tree", 14, False)] > by[(tp, 140, f"{mode} tree", 0, False)]
    for tp, _, at, below in thresholds:
        assert at and not below, (tp, at, below)
    for fam in ("glm", "glm5"):  # at TP=2 rank 0's: the largest TP rank, whose count the model gives
        glm = res[fam]
        for tp, P, mode, bt, measured, analytic in glm:
            print(f"{fam} tp={tp} P={P} {mode:>13} batch_tokens={bt:>2}: FlopCounterMode {measured:,} "
                  f"analytic {analytic:,.0f}")
        # TP=1: P=30 and P=1, TP=2: P=30; each detached and exact at 2 token budgets, and naive; P=30's trees
        # (GLM-5.3: TP=1 P=30 with its tree; TP=2 detached at one budget, and naive)
        assert len(glm) == (3 * (4 + 1) + 2 * 4 if fam == "glm" else (4 + 1) + 4 + (1 + 1))
        for tp, P, mode, bt, measured, analytic in glm:
            assert measured == analytic and measured > 0, (fam, tp, P, mode, bt, measured, analytic)


def test_padded_steps_are_the_executors_micro_steps():
    """planner/flops.py `padded_steps` cuts the executor's micro-steps (replay/plan.py `replay_steps`,
    replay/tree.py `tree_steps`): (branches, the longest's tokens) of each, flat and a prefix tree whose
    nodes' tails differ in length. The padding enters the algorithm count only: the minimum and the
    conventional 3x count are the same at every budget, and budget 0 is one branch per micro-step."""
    import os

    from longstraw_mcore.config import load_config
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.flops import padded_steps, step_flops
    from longstraw_mcore.replay.plan import replay_steps
    from longstraw_mcore.replay.tree import build_tree, tree_pieces, tree_steps

    lens = [5, 1, 9, 3]
    for budget in (0, 12, 100):
        flat = [(len(st.branches), max(lens[b] for b in st.branches)) for st in replay_steps(range(4), lens, budget)]
        assert [(B, T) for B, T, _, _ in padded_steps(lens, budget)] == flat
    assert padded_steps(lens, 12) == [(2, 5, (), False), (1, 9, (), False), (1, 3, (), False)]
    # r0..r6: a b c d e | a b c f | a b g h h h | a b x | h i | h j j j | k
    responses = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 8, 8], [1, 2, 9], [8, 9], [8, 10, 10, 10], [11]]
    root = build_tree(responses)
    tl = [len(r) for r in responses]
    for budget in (0, 4, 6, 100):
        steps = [(len(st.branches), max(tl[b] - st.span[0] for b in st.branches), False) if st.phase == "replay"
                 else (1, st.span[1] - st.span[0], True) for st in tree_steps(root, tl, budget)
                 if st.phase in ("replay", "segment")]
        ours = [(B, T, seeded) for B, T, _, seeded in padded_steps(tree_pieces(root, responses), budget)]
        assert sorted(ours) == sorted(steps), budget

    root_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    m = load_config(os.path.join(root_dir, "configs", "qwen3.6-tiny.yaml"), []).model
    layers = get_family(m.family).layers
    for mode in ("detached", "exact"):
        for group in ([40, 21, 1], tree_pieces(root, responses)):
            one, padded = (step_flops(layers, m, 140, group, mode, 64, batch_tokens=bt) for bt in (0, 100))
            assert one == step_flops(layers, m, 140, group, mode, 64)  # the default: one branch per micro-step
            assert padded["algorithm"]["replay"] > one["algorithm"]["replay"], mode
            assert padded["minimum"] == one["minimum"] and padded["model_3x"] == one["model_3x"], mode
            assert padded["algorithm"]["capture"] == one["algorithm"]["capture"]
