"""`longstraw validate` (tiny 4-layer GLM-5.2: MLA + DSA + MoE, float64, exact mode): the receipt's
grad_norm is the norm of the gradients it dumps, and a data-parallel rank without a prompt group of its
own never leaves its peers waiting.

- grad_norm against the L2 norm of grads.safetensors (every gradient under its Hugging Face name, the
  routed experts of every EP rank included) <= 1e-12 relative, at one rank, EP=2 (DP=2), EP=4 (DP=4)
  and PP=2 x CP=2 x EP=2 (the 78-layer PP x CP x EP layout: tests/dist/test_glm_validate_cli.py).
  Before, the routed experts of other EP ranks were left out (1.5749 against 1.5839 at EP=2).
- fewer groups than data-parallel ranks: one group on EP=2 (DP=2), where the idle rank's MoE layers
  must still exchange tokens (it replays the group as a stand-in with no gradient), on PP=2 (DP=2) and
  on CP=2 (DP=2); each completes, and its loss, log-probs and gradients equal the one-rank run's
  (<= 1e-10, the layout tests' bound): the stand-in adds nothing. (It used to hang at EP=2: one rank in the EP lockstep's
  all_gather_object, the other in finalize_model_grads.)"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file

from launch import ROOT, longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

sys.path.insert(0, os.path.join(ROOT, "tools"))


def _norm(out) -> tuple[float, float]:
    r = json.loads((out / "receipt.json").read_text())
    grads = load_file(str(out / "grads.safetensors"))
    dumped = sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5
    return r["grad_norm"], dumped


def test_receipt_grad_norm_is_the_dumped_norm_and_idle_data_parallel_ranks_complete(tmp_path):
    from compare_validate import compare
    from make_rollouts import make_groups

    from longstraw_mcore.config import load_config
    from longstraw_mcore.data.rollouts import write_rollouts
    from test_glm_validate_cli import _tool

    cfg = "configs/glm-5.2-tiny.yaml"
    hf = tmp_path / "hf"
    _tool("tools/make_hf_model.py", str(hf), "--config", cfg, "--seed", "3", "model.dtype=float64", "model.num_layers=4")
    m = load_config(cfg).model
    one_group, two_groups = tmp_path / "r1.jsonl", tmp_path / "r2.jsonl"
    write_rollouts(one_group, make_groups(m.vocab_size, 1, 13, 2, 3, seed=5))
    write_rollouts(two_groups, make_groups(m.vocab_size, 2, 13, 2, 3, seed=6))
    common = ("--mode", "exact", "--dump-grads", "replay.chunk_len=8", "device=cpu", "model.num_layers=4",
              "model.dtype=float64")
    runs = {  # name: (ranks, rollouts, layout)
        "one rank": (1, one_group, ()),
        "EP=2, 1 group for DP=2": (2, one_group, ("parallel.ep=2",)),
        "EP=4, 2 groups for DP=4": (4, two_groups, ("parallel.ep=4",)),
        "PP=2 x CP=2 x EP=2": (4, two_groups, ("parallel.pp=2", "parallel.pp_layers=[2,2]", "parallel.cp=2",
                                               "parallel.ep=2")),
        "PP=2, 1 group for DP=2": (4, one_group, ("parallel.pp=2", "parallel.pp_layers=[2,2]")),
        "CP=2, 1 group for DP=2": (4, one_group, ("parallel.cp=2",)),
    }
    for i, (name, (n, rollouts, layout)) in enumerate(runs.items()):
        out = tmp_path / f"v{i}"
        r = longstraw(n, "validate", "--hf", str(hf), "--rollouts", str(rollouts), "--out", str(out), *common, *layout,
                      timeout=600)  # a hang fails here
        assert r.returncode == 0, (name, r.stderr[-3000:])
        got, dumped = _norm(out)
        print(f"{name}: receipt grad_norm {got!r}, dumped gradients' norm {dumped!r}, relative "
              f"{abs(got - dumped) / dumped:.1e}")
        assert abs(got - dumped) <= 1e-12 * dumped, (name, got, dumped)
    for i in (1, 4, 5):  # one group on two data-parallel ranks = the one-rank step
        diff = compare(tmp_path / f"v{i}", tmp_path / "v0")
        print(f"{list(runs)[i]} vs one rank: loss {diff['loss']:.1e}, logp {diff['logprob_abs']:.1e}, worst gradient "
              f"{diff['grad_worst']:.1e}")
        assert diff["loss"] <= 1e-10 and diff["logprob_abs"] <= 1e-10 and diff["grad_worst"] <= 1e-10, (i, diff)
