"""Checkpoints are atomic and a resume continues bit-exactly whatever point a death interrupted.

Two gloo ranks (data parallel 2, Megatron's distributed optimizer, exact mode, tiny model). The
reference run trains steps 1-4 without interruption. Then, for every publication point of
train/checkpoints.py ("model", "optimizer", "metadata", "published", "latest"), a run saves step 2,
trains step 3, and dies while saving step 3 at that point (every rank raises there, no clean-up
runs); a fresh trainer resumes from the directory: before "published" it must come back at step 2
(the half-written step 3 ignored and removed), after it at step 3 (complete even where `latest` still
names step 2), and steps up to 4 must reproduce the reference's metrics and final weights exactly.
A newest checkpoint with a truncated shard is skipped with a message naming the file and the run
falls back to the previous one, re-running to (and replacing) the damaged step; with no complete
checkpoint left the error names the file. A newest checkpoint whose `.metadata` pickles a call to os.system
(checkpoint/no_pickle.py) is refused the same way, naming the file and the call, and the call never runs. Not
covered: a death of one rank alone (the others then
block in the next collective until the launcher kills them, which leaves the same files)."""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


class Died(Exception):
    pass


def _setup():
    from hf_reference import tiny_model_config

    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig, TrainConfig
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.parallel.groups import setup_parallel

    m = tiny_model_config(dtype="float32")
    cfg = RunConfig(model=m, parallel=ParallelConfig(), device="cpu", replay=ReplayConfig(mode="exact", chunk_len=6),
                    train=TrainConfig(lr=1e-3, distributed_optimizer=True))
    par = setup_parallel(cfg)
    g = torch.Generator().manual_seed(7)
    groups = [RolloutGroup(prompt=torch.randint(0, m.vocab_size, (14,), generator=g).tolist(),
                           responses=[torch.randint(0, m.vocab_size, (n,), generator=g).tolist() for n in (3, 5, 2)],
                           rewards=torch.rand(3, generator=g).tolist()) for _ in range(8)]
    return cfg, par, groups


def _trainer(cfg, par, groups, logs):
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.train.trainer import Trainer, build_optimizer, wrap_ddp

    torch.manual_seed(cfg.seed)  # the same initial weights for every trainer built here
    model = build_model(cfg.model, par, "cpu")
    ddp = wrap_ddp(model, cfg, par)
    return Trainer(cfg, par, ddp, build_optimizer(ddp, cfg, par), groups, log=logs.append)


def _params(tr):
    return torch.cat([p.detach().flatten().double() for p in tr.ddp.module.parameters()])


def _strip(history):
    return [{k: v for k, v in m.items() if k not in ("seconds", "peak_bytes")} for m in history]


def _worker(rank, world_size, tmpdir):
    import os
    from pathlib import Path

    import torch.distributed as dist

    from longstraw_mcore.checkpoint.qwen3_5 import CheckpointError
    from longstraw_mcore.train.checkpoints import POINTS

    cfg, par, groups = _setup()
    ref = _trainer(cfg, par, groups, [])
    for _ in range(4):
        ref.run_step()
    want_hist, want_params = _strip(ref.history), _params(ref)
    out = {"points": {}}

    def continue_to_4(tr):
        while tr.step < 4:
            tr.run_step()
        return _strip(tr.history) == want_hist and torch.equal(_params(tr), want_params)

    for point in POINTS:
        root = Path(tmpdir) / point
        tr = _trainer(cfg, par, groups, [])
        tr.run_step(), tr.run_step()
        tr.save(root)
        tr.run_step()

        def die(p, point=point):
            if p == point:
                raise Died(p)

        try:
            tr.save(root, fault=die)
        except Died:
            pass
        dist.barrier()
        left = sorted(os.listdir(root))
        logs = []
        fresh = _trainer(cfg, par, groups, logs)
        assert fresh.resume(root)
        resumed_at = fresh.step
        out["points"][point] = dict(left=left, resumed_at=resumed_at, exact=continue_to_4(fresh), logs=logs,
                                    after=sorted(os.listdir(root)))
        fresh.save(root)  # re-running to an existing step: publishes step_4 (and step_3 had been replaced or not)

    # a truncated shard in the newest checkpoint: announced fallback, re-run, the damaged step replaced
    root = Path(tmpdir) / "latest"  # the directory of the last point: steps 2, 3, 4 complete
    victim = sorted((root / "step_000004").glob("*.distcp"))[0]
    dist.barrier()
    if rank == 0:
        victim.write_bytes(victim.read_bytes()[:-7])
    dist.barrier()
    logs = []
    fresh = _trainer(cfg, par, groups, logs)
    fresh.resume(root)
    out["fallback"] = dict(step=fresh.step, logs=logs, victim=str(victim))
    out["fallback"]["exact"] = continue_to_4(fresh)
    fresh.save(root)
    logs2 = []
    again = _trainer(cfg, par, groups, logs2)
    again.resume(root)
    out["replaced"] = dict(step=again.step, logs=logs2)
    # a crafted newest checkpoint: refused without running what it names, announced, fallen back from
    import pickle

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {tmpdir}/ran",))
    dist.barrier()
    if rank == 0:  # (and its manifest, as whoever crafted it would)
        import json

        step4 = root / "step_000004"
        (step4 / ".metadata").write_bytes(pickle.dumps(RunsCode()))
        manifest = json.loads((step4 / "manifest.json").read_text())
        manifest["files"][".metadata"] = (step4 / ".metadata").stat().st_size
        (step4 / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()
    logs3 = []
    crafted = _trainer(cfg, par, groups, logs3)
    crafted.resume(root)
    out["crafted"] = dict(step=crafted.step, logs=logs3, ran=os.path.exists(f"{tmpdir}/ran"))
    # nothing complete left: a clear error naming the file
    only = Path(tmpdir) / "only"
    only.mkdir(exist_ok=True)
    dist.barrier()
    if rank == 0:
        os.rename(root / "step_000004", only / "step_000004")
        v = sorted((only / "step_000004").glob("*.distcp"))[0]
        v.write_bytes(v.read_bytes()[:-3])
    dist.barrier()
    try:
        _trainer(cfg, par, groups, []).resume(only)
        out["error"] = None
    except CheckpointError as e:
        out["error"] = str(e)
    return out


def test_death_at_every_publication_point_then_resume_is_bit_exact(tmp_path):
    out = run_ranks(_worker, 2, str(tmp_path), timeout_s=900)[0]
    for point, r in out["points"].items():
        print(f"death at {point!r}: left {r['left']}, resumed at step {r['resumed_at']}, steps to 4 bit-exact: "
              f"{r['exact']}; {r['logs']}")
    for point, r in out["points"].items():
        published = point in ("published", "latest")
        assert r["resumed_at"] == (3 if published else 2), (point, r)
        assert r["exact"], point
        assert (".step_000003.partial" in r["left"]) == (not published), (point, r["left"])
        assert not any(n.startswith(".step_") for n in r["after"]), (point, r["after"])  # cleaned on resume
    assert any("`latest` names step_000002" in line for line in out["points"]["published"]["logs"])
    fb = out["fallback"]
    print(f"truncated shard: {fb['logs']}")
    assert fb["step"] == 3 and fb["exact"]
    assert any("skipping step_000004" in line and fb["victim"] in line for line in fb["logs"]), fb["logs"]
    assert out["replaced"]["step"] == 4 and not any("skipping" in line for line in out["replaced"]["logs"])
    cr = out["crafted"]
    print(f"crafted .metadata: {cr['logs']}")
    assert cr["step"] == 3 and not cr["ran"], cr
    assert any("skipping step_000004" in line and "step_000004/.metadata: refusing to read it (it asks for "
               "posix.system)" in line for line in cr["logs"]), cr["logs"]
    assert out["error"] is not None and "step_000004" in out["error"] and ".distcp" in out["error"], out["error"]
