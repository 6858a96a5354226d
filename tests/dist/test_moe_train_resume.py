"""Full-parameter training of a MoE model saves and resumes its optimizer state (train/optimizer_state.py):
GLM-5.2-tiny cut to 4 layers (3 dense, then one MoE layer of 4 routed SwiGLU experts and a shared one),
float32, Megatron's optimizer, at EP=2 (2 gloo ranks, dp=2: each rank holds 2 experts; one rank runs the same code).

Megatron's SequentialMLP gives every local expert the same checkpoint key (`...experts.experts.linear_fc1
.weight`, fc1 a factory splitting gate and up), each with its own offset on the stacked expert axis; an
optimizer state keyed by that key kept the last expert's only and the save failed. Here: 3 steps with
checkpoints at steps 2 and 3; the step-3 one is set aside and `--resume` from step 2 must give step 3
bit for bit: the same metrics, and a step-3 checkpoint whose every tensor (weights, Adam's two moments per
expert) equals the uninterrupted run's, read back with torch's own reader (not the project's). The
experts' step-2 moments differ between experts (a state mapped to one expert would change step 3)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from launch import longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

EXPERTS = "decoder.layers.3.mlp.experts.experts"
VOLATILE = {"seconds", "peak_bytes"}


def _read(directory, out):
    """Every tensor of a Megatron (torch_dist) checkpoint directory, whole, by its checkpoint key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(directory), str(out))
    return torch.load(out, weights_only=False)


def test_moe_full_parameter_resume_is_bit_exact_ep2(tmp_path):
    from make_rollouts import make_groups

    from longstraw_mcore.data.rollouts import write_rollouts

    rollouts = tmp_path / "r.jsonl"
    write_rollouts(rollouts, make_groups(256, 6, 24, 3, 8, seed=4))
    common = ["--config", "configs/glm-5.2-tiny.yaml", "--rollouts", str(rollouts), "--steps", "3",
              "model.num_layers=4", "train.lr=1e-2", "train.save_every=2"]
    for n, layout in ((2, ["parallel.ep=2"]),):  # (one rank is the same code path; CI time)
        ck, full, resumed = tmp_path / f"ck{n}", tmp_path / f"full{n}.jsonl", tmp_path / f"resumed{n}.jsonl"
        r = longstraw(n, "train", *common, "--save", str(ck), "--metrics-out", str(full), *layout)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"dp={n}" in r.stdout, r.stdout[-2000:]
        (ck / "step_000003").rename(tmp_path / f"uninterrupted{n}")
        (ck / "latest").write_text("step_000002")
        r = longstraw(n, "train", *common, "--save", str(ck), "--resume", "--metrics-out", str(resumed), *layout)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout and "at step 2" in r.stdout and "resharding" not in r.stdout, r.stdout[-2000:]
        a = [json.loads(x) for x in open(full)]
        b = [json.loads(x) for x in open(resumed)]
        assert [m["step"] for m in a] == [1, 2, 3] and [m["step"] for m in b] == [3], (a, b)
        assert all(m["update_ok"] for m in a), a
        assert {k: v for k, v in a[2].items() if k not in VOLATILE} == {k: v for k, v in b[0].items()
                                                                         if k not in VOLATILE}, (a[2], b[0])

        saved = _read(ck / "step_000002" / "optimizer", tmp_path / f"o2_{n}.pt")
        moments = {k: saved[f"optimizer.{k}.{EXPERTS}.{fc}.weight"] for k in ("exp_avg", "exp_avg_sq")
                   for fc in ("linear_fc1", "linear_fc2")}
        assert all(m.shape[0] == 4 for m in moments.values()), {k: m.shape for k, m in moments.items()}
        for name, m in moments.items():  # every expert trained, each with moments of its own
            assert all(m[e].abs().max() > 0 for e in range(4)), (name, m.flatten(1).abs().amax(1))
            assert all(not torch.equal(m[e], m[f]) for e in range(4) for f in range(e)), name

        for part in ("optimizer", ""):  # the step-3 checkpoints: Adam's state, then the weights
            x = _read(tmp_path / f"uninterrupted{n}" / part, tmp_path / f"x{n}{part}.pt")
            y = _read(ck / "step_000003" / part, tmp_path / f"y{n}{part}.pt")
            tensors = sorted(k for k, v in x.items() if isinstance(v, torch.Tensor))
            assert sorted(k for k, v in y.items() if isinstance(v, torch.Tensor)) == tensors
            assert any(EXPERTS in k for k in tensors), tensors
            differ = [k for k in tensors if not torch.equal(x[k], y[k])]
            assert not differ, (n, part, differ)
            changed = [k for k in tensors if k.startswith(f"optimizer.exp_avg.{EXPERTS}") and
                       not torch.equal(x[k], saved[k])]
            assert part != "optimizer" or len(changed) == 2, changed  # step 3 moved both experts' moments
        print(f"EP={n}: step 3 after resume = uninterrupted bit for bit (loss {b[0]['loss']:.9f}, grad norm "
              f"{b[0]['grad_norm']:.9f}); {len(tensors)} weight tensors and the optimizer state equal")
        shutil.rmtree(ck)
