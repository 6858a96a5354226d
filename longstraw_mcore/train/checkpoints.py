"""Training checkpoints: published atomically, verified before use, resumed with an announced fallback.

Layout under `--save ROOT`:

    step_000010/              a complete checkpoint: the model as a Megatron distributed checkpoint
                              (layout-free; with adapters, only they, as a PEFT directory `adapter/`:
                              the frozen base is the run's --hf), optimizer/ (Adam's state in the model's
                              coordinates: train/optimizer_state.py, resumes at any layout; with the distributed
                              optimizer or adapters instead optimizer_rank*.pt, the torch optimizers' states
                              per rank: the same layout only), longstraw_model.json
                              (model config, layout, step), metrics.json, manifest.json (size of
                              every other file)
    latest                    name of the newest published step, switched last (atomic rename)
    .step_000012.partial/     being written, or left by a death: never read, removed on the next
                              save or resume

Publication, in order (the points a death can interrupt; `fault(point)` is called at each, for tests):
    "model"      every rank wrote its model shards into the .partial directory
    "optimizer"  every rank wrote its optimizer file
    "metadata"   rank 0 wrote the metadata, the metrics and the manifest
    "published"  .partial renamed to step_N (an older step_N, e.g. a damaged one, is replaced)
    "latest"     `latest` switched to step_N
A step directory therefore exists only complete. Resume takes the newest step directory whose files
match its manifest: after a death between "published" and "latest" that is step_N (complete) while
`latest` still names the previous one, and the run says so. A damaged newest checkpoint (a file
missing or of the wrong size, or unreadable) is skipped with a message naming the file, falling back
to the previous complete one; with none left the error names the file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from longstraw_mcore.checkpoint.dist_ckpt import CONFIG_FILE, load_checkpoint, meta_dict, write_model_shards
from longstraw_mcore.checkpoint.common import CheckpointError
from longstraw_mcore.checkpoint.no_pickle import load_torch_file
from longstraw_mcore.train.checkpoint_dirs import POINTS  # noqa: F401 - re-exported (the publication points)
from longstraw_mcore.train.checkpoint_dirs import clean_unpublished, published_steps, step_dir, verify, write_manifest

ADAPTER_DIR = "adapter"

def _write_model(model, tmp: Path) -> None:
    """The trainable weights: the model's shards, or with adapters the whole adapters (rank 0 writes)."""
    from longstraw_mcore.adapters.attach import adapter_set

    aset = adapter_set(model)
    if aset is None:
        write_model_shards(model, tmp)
        return
    from longstraw_mcore.adapters.peft_io import gather_canonical, gather_saved, write_peft

    tensors, whole = gather_canonical(aset, aset.parallel), gather_saved(aset, aset.parallel)
    if dist.get_rank() == 0:
        write_peft(tmp / ADAPTER_DIR, tensors, aset.cfg, sorted({s.target for s in aset.sites.values()}),
                   saved=whole)


def _load_model(model, path: Path) -> None:
    from longstraw_mcore.adapters.attach import adapter_set, load_canonical

    aset = adapter_set(model)
    if aset is None:
        load_checkpoint(model, path)
        return
    from longstraw_mcore.adapters.peft_io import CRITIC_SAVED_NAMES, read_peft, read_saved

    if not (path / ADAPTER_DIR).is_dir():
        raise CheckpointError(f"{path}: no {ADAPTER_DIR}/ (a full-parameter checkpoint; this run trains adapters)")
    shapes = {n: tuple(p.shape) for n, p in aset.saved.items()}  # (the last stage's; elsewhere none to read)
    cfg, canonical = read_peft(path / ADAPTER_DIR, list(aset.sites.values()), aset.cfg,
                               saved=CRITIC_SAVED_NAMES)
    if (cfg.rank, cfg.alpha) != (aset.cfg.rank, aset.cfg.alpha):
        raise CheckpointError(f"{path / ADAPTER_DIR}: r={cfg.rank}, alpha={cfg.alpha}; this run's adapter is "
                              f"r={aset.cfg.rank}, alpha={aset.cfg.alpha}")
    whole = read_saved(path / ADAPTER_DIR, shapes) if shapes else None
    if shapes and set(whole) != set(shapes):
        raise CheckpointError(f"{path / ADAPTER_DIR}: no {sorted(set(shapes) - set(whole))} beside the adapters "
                              "(a critic's checkpoint keeps its value head whole)")
    load_canonical(aset, canonical, whole)


def save_step(root: str | Path, step: int, model, torch_optimizers: list, model_cfg, layout: dict, history: list,
              extra: dict, fault: Callable[[str], None] | None = None, rank_extra: dict | None = None,
              optimizer=None, files: Callable[[Path], None] | None = None) -> Path:
    """Write and publish step `step` from every rank (collective). `optimizer`: written layout-free
    (train/optimizer_state.py) into `optimizer/`; None: the torch optimizers' states per rank. `files(tmp)`: rank 0
    writes further files into the step before its manifest (checkpoint/passthrough.py's kept tensors)."""
    fault = fault or (lambda point: None)
    root = Path(root).resolve()
    rank = dist.get_rank()
    dst, tmp = step_dir(root, step), root / f".step_{step:06d}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    _write_model(model, tmp)
    fault("model")
    if optimizer is not None:
        from longstraw_mcore.train import optimizer_state

        optimizer_state.save(optimizer, model, tmp / optimizer_state.OPTIMIZER_DIR)
    else:
        opt_file = tmp / f"optimizer_rank{rank:05d}.pt"
        torch.save({"torch_optimizers": [o.state_dict() for o in torch_optimizers], "layout": layout, "rank": rank,
                    "extra": rank_extra}, opt_file)
    dist.barrier()
    fault("optimizer")
    if rank == 0:
        if files is not None:
            files(tmp)
        (tmp / CONFIG_FILE).write_text(json.dumps(meta_dict(model_cfg, layout, {"step": step, **extra}), indent=2))
        (tmp / "metrics.json").write_text(json.dumps(history))
        write_manifest(tmp)
    dist.barrier()
    fault("metadata")
    if rank == 0:
        stale = root / f".step_{step:06d}.stale"
        if dst.exists():  # an earlier run's step_N (e.g. a damaged one we fell back from): replace it
            os.replace(dst, stale)
        os.replace(tmp, dst)
        shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    fault("published")
    if rank == 0:
        pointer = root / ".latest.tmp"
        pointer.write_text(dst.name)
        os.replace(pointer, root / "latest")
    dist.barrier()
    fault("latest")
    return dst


def _load_optimizers(path: Path, torch_optimizers: list, load_extra) -> str | None:
    f = path / f"optimizer_rank{dist.get_rank():05d}.pt"
    try:
        blob = load_torch_file(f)  # weights-only: tensors and plain data (checkpoint/no_pickle.py)
        with torch.no_grad():
            for o, sd in zip(torch_optimizers, blob["torch_optimizers"], strict=True):
                o.load_state_dict(sd)
            if load_extra is not None:
                load_extra(blob["extra"])
    except Exception as e:  # noqa: BLE001 - turned into one CheckpointError on every rank
        return f"{f}: {type(e).__name__}: {e}"
    return None


def load_step(path: Path, model, torch_optimizers: list, reload_main_params: Callable[[], None],
              load_extra: Callable[[dict], None] | None = None, optimizer=None) -> tuple[int, list]:
    """Load model and optimizer states of a verified step directory (collective); (step, metrics). A
    layout-free optimizer state (`optimizer/`) goes into `optimizer`, per-rank files into the torch
    optimizers."""
    from longstraw_mcore.checkpoint.dist_ckpt import read_checkpoint_meta

    _, meta = read_checkpoint_meta(path)
    try:
        _load_model(model, path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: the model shards do not load: {type(e).__name__}: {e}") from None
    reload_main_params()  # main (fp32 / sharded) params from the loaded model params
    from longstraw_mcore.train import optimizer_state

    if (path / optimizer_state.OPTIMIZER_DIR).is_dir():
        try:
            optimizer_state.load(optimizer, model, path / optimizer_state.OPTIMIZER_DIR)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path / optimizer_state.OPTIMIZER_DIR}: the optimizer state does not load: "
                                  f"{type(e).__name__}: {e}") from None
        return int(meta["step"]), json.loads((path / "metrics.json").read_text())
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, _load_optimizers(path, torch_optimizers, load_extra))
    bad = [e for e in errors if e is not None]
    if bad:
        raise CheckpointError(bad[0])
    return int(meta["step"]), json.loads((path / "metrics.json").read_text())


def resume_newest(root: str | Path, load: Callable[[Path], tuple[int, list]], log=print) -> tuple[int, list] | None:
    """Clean half-written directories, then load the newest step directory that verifies and loads
    (collective; rank 0 decides, every rank follows). Newer ones skipped are announced with the
    reason; None when `root` holds no checkpoint; CheckpointError when none is usable."""
    root = Path(root)
    rank0 = dist.get_rank() == 0
    box = [None]
    if rank0:
        for p in clean_unpublished(root) if root.is_dir() else []:
            log(f"[resume] removed {p.name}: left half-written by an earlier run")
        box = [[(str(d), verify(d)) for _, d in reversed(published_steps(root))]]
    dist.broadcast_object_list(box, src=0)
    candidates = box[0]
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    problems = []
    for path, problem in candidates:
        path = Path(path)
        if problem is None:
            try:
                got = load(path)
            except CheckpointError as e:
                problem = str(e)
        if problem is not None:
            problems.append(problem)
            if rank0:
                log(f"[resume] skipping {path.name}: {problem}; falling back to an earlier checkpoint")
            continue
        if rank0 and not problems and latest is not None and latest < path.name:  # step_NNNNNN sorts by step
            log(f"[resume] {path.name} is complete but `latest` names {latest} (the run stopped before switching "
                f"it): resuming from {path.name}")
        return got
    if problems:
        raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(problems))
    return None
