"""A full-parameter run keeps the tensors its source holds beside the decoder (checkpoint/passthrough.py: a VLM's
vision tower) in every step it saves: the tiny Qwen model (one gloo rank) with two such tensors handed to its trainer
as a run from --hf would (api.Session.build), saved at steps 0 and 1. Each step holds them (in its manifest) with the
recorded config.json, the second a hard link to the first's; `mcore_to_hf_dir` of step 1 writes them bit for bit
beside the trained decoder under that config.json; the Python API hands them out last (`hf_weights`) with the same
config (`hf_config`); a resumed trainer reads them from the step it resumed."""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


def _trainer(cfg, par, groups):
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.train.trainer import Trainer, build_optimizer, wrap_ddp

    torch.manual_seed(cfg.seed)
    ddp = wrap_ddp(build_model(cfg.model, par, "cpu"), cfg, par)
    return Trainer(cfg, par, ddp, build_optimizer(ddp, cfg, par), groups, log=lambda *_: None)


def _worker(rank, world_size, tmp):
    import json
    import os
    from pathlib import Path

    from hf_reference import tiny_model_config
    from safetensors.torch import load_file

    from longstraw_mcore.api import Session
    from longstraw_mcore.checkpoint import passthrough
    from longstraw_mcore.checkpoint.convert import mcore_to_hf_dir
    from longstraw_mcore.checkpoint.dist_ckpt import read_checkpoint_meta
    from longstraw_mcore.checkpoint.qwen3_5 import hf_config_dict
    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig, TrainConfig
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.train.checkpoint_dirs import MANIFEST, verify

    tmp = Path(tmp)
    m = tiny_model_config(dtype="float32")
    cfg = RunConfig(model=m, parallel=ParallelConfig(), device="cpu", replay=ReplayConfig(mode="exact", chunk_len=6),
                    train=TrainConfig(lr=1e-3, groups_per_step=1))
    par = setup_parallel(cfg)
    g = torch.Generator().manual_seed(7)
    groups = [RolloutGroup(prompt=torch.randint(0, m.vocab_size, (14,), generator=g).tolist(),
                           responses=[torch.randint(0, m.vocab_size, (n,), generator=g).tolist() for n in (3, 5)],
                           rewards=[0.2, 0.9])]
    tr = _trainer(cfg, par, groups)
    raw = {**hf_config_dict(m), "marker": "recorded"}  # decoder-only: given back as is
    kept = {"model.visual.patch.weight": torch.randn(3, 4, generator=g).bfloat16(),
            "model.visual.scale": torch.randn(2, generator=g)}
    tr.passthrough = passthrough.Source(raw, tensors=kept, keep=sorted(kept))
    root = tmp / "ckpt"
    s0 = tr.save(root)
    tr.run_step()
    s1 = tr.save(root)
    files = json.loads((s1 / MANIFEST).read_text())["files"]
    linked = os.stat(s0 / passthrough.FILE).st_ino == os.stat(s1 / passthrough.FILE).st_ino
    meta = read_checkpoint_meta(s1)[1]
    mcore_to_hf_dir(get_family("qwen3_5"), s1, tmp / "hf", log=lambda *_: None)
    exported = load_file(str(tmp / "hf" / "model.safetensors"))
    handed = [(n, t) for n, t in Session(cfg, par, None, tr.ddp, tr.opt, tr).hf_weights()]
    config = Session(cfg, par, None, tr.ddp, tr.opt, tr).hf_config()
    again = _trainer(cfg, par, groups)
    resumed = again.resume(root)
    return {"in_manifest": passthrough.FILE in files, "verify": verify(s1), "linked": linked,
            "meta_config": meta.get("hf_config") == raw, "following": tr.passthrough.file == s1 / passthrough.FILE,
            "exported_kept": {n: torch.equal(exported[n], t) and exported[n].dtype == t.dtype for n, t in kept.items()},
            "exported_n": len(exported), "exported_config": json.loads((tmp / "hf" / "config.json").read_text()) == raw,
            "handed_tail": [n for n, _ in handed[-2:]],
            "handed_equal": all(torch.equal(t, kept[n]) for n, t in handed[-2:]), "handed_n": len(handed),
            "config": config == raw, "resumed": resumed and again.step == 1,
            "resumed_from": again.passthrough.file == s1 / passthrough.FILE}


def test_training_steps_carry_the_kept_tensors(tmp_path):
    got = run_ranks(_worker, 1, str(tmp_path), timeout_s=600)[0]
    print(got)
    assert got["in_manifest"] and got["verify"] is None and got["linked"] and got["meta_config"], got
    assert got["following"] and got["exported_config"] and got["config"], got
    assert got["exported_kept"] == {"model.visual.patch.weight": True, "model.visual.scale": True}, got
    assert got["handed_tail"] == ["model.visual.patch.weight", "model.visual.scale"] and got["handed_equal"], got
    assert got["exported_n"] == got["handed_n"] > 2, got  # the decoder's tensors and the two kept ones
    assert got["resumed"] and got["resumed_from"], got
