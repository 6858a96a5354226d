"""The optimizer's state in the model's own coordinates, so a checkpoint resumes at any layout.

Adam keeps, per parameter, two moments and (below float32 models) a float32 master copy, and one step
count. Here each of them is written as a tensor shaped like the parameter's local shard, described by
the parameter's own entry in the model's sharded state dict (Megatron's ShardedTensor or factory:
its key, global shape, offsets, replica), as `optimizer.<state>.<key>` in a Megatron distributed
checkpoint (`STEP_DIR/optimizer/`). Megatron's checkpointing then writes each value once and reads it
back at any (tp, pp, cp, ep, dp), exactly as it does the model; the step count is common to every
parameter (Adam steps them together) and is stored once.

Where the state lives before it is written, by optimizer (train/trainer.py build_training):
- train.grad_reduction=micro_step (train/zero2.py ShardedAdam): each parameter's state is a flat piece
  per rank of the data x context parallel group; the pieces are gathered into the local shape to save
  and each rank takes its piece of what it loads;
- train.grad_reduction=step, Megatron's Float16OptimizerWithFloat16Params (bf16) or FP32Optimizer (fp32;
  the master is the parameter itself, in the model checkpoint), each of a ChainedOptimizer's parts.
Not handled, said by `supported()`: Megatron's distributed optimizer (its state is cut along its own
gradient buffer, not along parameters) and adapters (theirs is a PEFT directory, not Megatron's sharded
state dict); those checkpoints keep the per-rank files and resume at the same layout only.

The values are the optimizer's own, moved, never recomputed: resuming at the same layout stays
bit-exact, and at another one equal up to the order of the sums the new layout makes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

OPTIMIZER_DIR = "optimizer"
STATES = ("exp_avg", "exp_avg_sq")


def supported(opt, model, cfg) -> str | None:
    """None when this run's optimizer state can be written layout-free; else why not."""
    if cfg.adapter.enabled:
        return "adapters (their optimizer state stays per rank)"
    if cfg.train.grad_reduction == "step" and cfg.train.distributed_optimizer:
        return "train.distributed_optimizer=true (Megatron's distributed optimizer shards its state along its buffer)"
    return None


def _megatron_parts(opt):
    return getattr(opt, "chained_optimizers", [opt])


def _slots(opt):
    """[(model parameter, torch optimizer, the tensor Adam updates, piece?)]: piece=True for ShardedAdam's
    flat pieces (zero2), False when the updated tensor is shaped like the parameter."""
    from longstraw_mcore.train.zero2 import ShardedAdam

    if isinstance(opt, ShardedAdam):
        return [(p, opt.optimizer, leaf, True) for p, leaf in zip(opt.s.params, opt.leaves)]
    out = []
    for part in _megatron_parts(opt):
        if getattr(part, "is_stub_optimizer", False):
            continue
        if hasattr(part, "float16_groups"):
            for model_g, main_g, fp32_g in zip(part.float16_groups, part.fp32_from_float16_groups,
                                               part.fp32_from_fp32_groups):
                out += [(p, part.optimizer, m, False) for p, m in zip(model_g, main_g)]
                out += [(p, part.optimizer, p, False) for p in fp32_g]
        else:
            out += [(p, part.optimizer, p, False) for g in part.optimizer.param_groups for p in g["params"]]
    return out


def _param_entries(model) -> dict:
    """id(parameter) -> its ShardedTensor / factory in the model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model.sharded_state_dict())
    return {id(t.data): t for t in nested_values(sharded)}


def _request(opt, model, tensors_of) -> tuple[dict, list, list]:
    """(the sharded dict of `tensors_of(slot) -> {state: parameter-shaped tensor}` over every slot, the
    slots, each slot's parameter key)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    entries = _param_entries(model)
    out, slots, keys = {}, _slots(opt), []
    for slot in slots:
        p = slot[0]
        if id(p) not in entries:
            raise RuntimeError(f"a trained parameter of shape {tuple(p.shape)} is not in the model's sharded state dict")
        keys.append(entries[id(p)].key)
        for name, t in tensors_of(slot).items():
            ent = make_sharded_optimizer_tensor(entries[id(p)], t, f"optimizer.{name}")
            out[ent.key] = ent
    return out, slots, keys


def _has_main(p, leaf) -> bool:
    """A master copy of its own (below float32 models); otherwise the model checkpoint holds the values."""
    return leaf is not p and leaf.dtype != p.dtype


def _dtype(leaf) -> torch.dtype:
    return torch.float64 if leaf.dtype == torch.float64 else torch.float32


def save(opt, model, directory: Path) -> None:
    """Write the optimizer state layout-free into `directory` (created empty; collective)."""
    from megatron.core import dist_checkpointing

    from longstraw_mcore.train.zero2 import ShardedAdam

    sharded = opt.s if isinstance(opt, ShardedAdam) else None
    steps = set()

    def tensors(slot):
        p, torch_opt, leaf, piece = slot
        st = torch_opt.state.get(leaf, {})
        steps.add(int(st["step"]) if "step" in st else 0)
        got = {k: st[k] if k in st else torch.zeros_like(leaf) for k in STATES}
        if _has_main(p, leaf):
            got["main"] = leaf
        if piece:
            got = {k: sharded.whole(p, v.detach()).clone() for k, v in got.items()}
        return {k: v.detach().to(_dtype(leaf)) for k, v in got.items()}

    request, _, _ = _request(opt, model, tensors)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(steps))
    common = sorted({s for mine in every for s in mine})
    if len(common) > 1:
        raise RuntimeError(f"Adam's step counts differ between parameters ({common}); a layout-free checkpoint "
                           "stores one")
    request["step"] = common[0] if common else 0
    directory.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(request, str(directory))


def load(opt, model, directory: Path) -> None:
    """Read a layout-free optimizer state into this run's optimizer (collective; any layout). The model's
    weights are loaded before (with them the master copies of float32 models)."""
    from megatron.core import dist_checkpointing

    from longstraw_mcore.train.zero2 import ShardedAdam

    sharded = opt.s if isinstance(opt, ShardedAdam) else None

    def empty(slot):
        p, _, leaf, _ = slot
        names = STATES + (("main",) if _has_main(p, leaf) else ())
        return {k: torch.empty(p.shape, dtype=_dtype(leaf), device=leaf.device) for k in names}

    request, slots, keys = _request(opt, model, empty)
    request["step"] = 0
    got = dist_checkpointing.load(request, str(directory))
    step = int(got["step"])
    with torch.no_grad():
        for (p, torch_opt, leaf, piece), key in zip(slots, keys):
            def mine(name):
                full = got[f"optimizer.{name}.{key}"]
                return sharded.piece(p, full.to(leaf.device)) if piece else full.to(leaf.device)
            st = torch_opt.state.setdefault(leaf, {})
            for k in STATES:
                st[k] = mine(k).to(leaf.dtype).clone()
            st["step"] = torch.tensor(float(step))
            if _has_main(p, leaf):
                leaf.copy_(mine("main"))
                if not piece:
                    p.data.copy_(leaf.to(p.dtype))
