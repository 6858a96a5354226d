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
- Megatron's DistributedOptimizer: each data-parallel rank updates a range of each parameter's flattened
  elements; the ranges are summed over its data-parallel group into the parameter's shape to save, and
  each rank takes its range of what it loads.
Not handled, said by `supported()`: adapters (theirs is a PEFT directory, not Megatron's sharded state
dict); their checkpoints keep the per-rank files and resume at the same layout only.

The values are the optimizer's own, moved, never recomputed: resuming at the same layout stays
bit-exact, and at another one equal up to the order of the sums the new layout makes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_mcore.checkpoint.no_pickle import check_dcp, one_line_errors

OPTIMIZER_DIR = "optimizer"
STATES = ("exp_avg", "exp_avg_sq")


def supported(opt, model) -> str | None:
    """None when `model`'s optimizer state can be written layout-free; else why not (read off the model: a
    policy's adapters and a critic's alike)."""
    from longstraw_mcore.adapters.attach import adapter_set
    from longstraw_mcore.models.chunks import ModelChunks

    if adapter_set(model) is not None:
        return "adapters (their optimizer state stays per rank)"
    if isinstance(getattr(model, "module", model), ModelChunks):
        return "model chunks (parallel.vpp > 1: the optimizer state stays per rank)"
    return None


class _Slot:
    """One trained parameter `p` and where its Adam state lives on this rank: `state` (the torch
    optimizer's dict for the tensor it updates, `leaf`; None where this rank holds no part of it),
    `full(t)` (collective: the parameter-shaped tensor from every rank's part `t`) and `mine(full)`
    (this rank's part of a parameter-shaped tensor)."""

    def __init__(self, p, torch_opt, leaf, full, mine):
        self.p, self.torch_opt, self.leaf, self.full, self.mine = p, torch_opt, leaf, full, mine

    @property
    def state(self):
        return None if self.leaf is None else self.torch_opt.state.setdefault(self.leaf, {})

    def has_main(self) -> bool:
        """A master copy of its own (below float32 models); otherwise the model checkpoint holds the values."""
        return self.p.dtype not in (torch.float32, torch.float64)


def _same(t):
    return t


def _distributed_slots(part) -> list[_Slot]:
    """Megatron's distributed optimizer: each data-parallel rank updates a range of each parameter's
    flattened elements (possibly none); the parts add up over its data-parallel group."""
    ranges = {q: r["param"] for per_buffer in part.gbuf_ranges for per_dtype in per_buffer.values()
              for bucket in per_dtype for q, r in bucket["param_map"].items()}  # this rank's
    out = []
    # every parameter of the buffers, in their order (the same on every rank; the ranges are not)
    for p in (q for buf in part.buffers for q in buf.param_index_map):
        leaf, span = None, None
        if p in ranges and p in part.model_param_group_index_map:
            gi, go = part.model_param_group_index_map[p]
            leaf, r = part.optimizer.param_groups[gi]["params"][go], ranges[p]
            span = (r.start, r.end)

        def full(t, p=p, span=span, group=part.data_parallel_group):
            out_ = torch.zeros(p.numel(), dtype=torch.float32 if t is None else t.dtype, device=p.device)
            if span is not None:
                out_[span[0]:span[1]] = t.reshape(-1)
            dist.all_reduce(out_, group=group)
            return out_.view(p.shape)

        def mine(f, span=span):
            return f.reshape(-1)[span[0]:span[1]]
        out.append(_Slot(p, part.optimizer, leaf, full, mine))
    return out


def _slots(opt) -> list[_Slot]:
    from longstraw_mcore.train.zero2 import ShardedAdam

    if isinstance(opt, ShardedAdam):
        s = opt.s
        return [_Slot(p, opt.optimizer, leaf, lambda t, p=p: s.whole(p, t), lambda f, p=p: s.piece(p, f))
                for p, leaf in zip(s.params, opt.leaves)]
    out = []
    for part in getattr(opt, "chained_optimizers", [opt]):
        if getattr(part, "is_stub_optimizer", False):
            continue
        if hasattr(part, "model_param_gbuf_map"):
            out += _distributed_slots(part)
        elif hasattr(part, "float16_groups"):
            for model_g, main_g, fp32_g in zip(part.float16_groups, part.fp32_from_float16_groups,
                                               part.fp32_from_fp32_groups):
                out += [_Slot(p, part.optimizer, m, _same, _same) for p, m in zip(model_g, main_g)]
                out += [_Slot(p, part.optimizer, p, _same, _same) for p in fp32_g]
        else:
            out += [_Slot(p, part.optimizer, p, _same, _same) for g in part.optimizer.param_groups for p in g["params"]]
    return out


def _param_entries(model) -> dict:
    """id(parameter) -> its ShardedTensor / factory in the model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model.sharded_state_dict())
    return {id(t.data): t for t in nested_values(sharded)}


def _request(slots, model, tensors_of) -> dict:
    """The sharded dict of `tensors_of(slot) -> {state: parameter-shaped tensor}`: slot i's under `slots.<i>`.
    Indexed by slot, not by the checkpoint key: a key is not one parameter's. The local experts of a MoE layer
    (Megatron's SequentialMLP) share theirs, `...experts.experts.linear_fc1.weight`, each its own part of
    the stacked expert axis (its global offset), as Megatron's own optimizer indexes its state by parameter
    (dist_checkpointing/optimizer.py optim_state_to_sharding_state)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    entries = _param_entries(model)
    out = {}
    for i, slot in enumerate(slots):
        if id(slot.p) not in entries:
            raise RuntimeError(f"a trained parameter of shape {tuple(slot.p.shape)} is not in the model's sharded "
                               "state dict")
        entry = entries[id(slot.p)]
        out[str(i)] = {name: make_sharded_optimizer_tensor(entry, t, f"optimizer.{name}")
                       for name, t in tensors_of(slot).items()}
    return {"slots": out}


def _dtype(p) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def save(opt, model, directory: Path) -> None:
    """Write the optimizer state layout-free into `directory` (created empty; collective). The gathered,
    parameter-shaped tensors wait in host memory for the writer: 8 bytes per element of this rank's
    parameters (12 below float32 models)."""
    from megatron.core import dist_checkpointing

    steps = set()

    def tensors(slot):
        st = slot.state
        if st is not None:
            steps.add(int(st["step"]) if "step" in st else 0)
        names = STATES + (("main",) if slot.has_main() else ())
        got = {}
        for k in names:
            local = None
            if st is not None:
                local = slot.leaf if k == "main" else st.get(k, torch.zeros_like(slot.leaf))
                local = local.detach().to(_dtype(slot.p))
            got[k] = slot.full(local).to("cpu", copy=True)
        return got

    slots = _slots(opt)
    request = _request(slots, model, tensors)
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

    def empty(slot):
        names = STATES + (("main",) if slot.has_main() else ())
        return {k: torch.empty(slot.p.shape, dtype=_dtype(slot.p)) for k in names}

    slots = _slots(opt)
    request = _request(slots, model, empty)
    request["step"] = 0
    check_dcp(directory)  # (only data: checkpoint/no_pickle.py)
    with one_line_errors(directory):
        got = dist_checkpointing.load(request, str(directory))
    step = int(got["step"])
    with torch.no_grad():
        for i, slot in enumerate(slots):
            mine = got["slots"][str(i)]
            st = slot.state
            if st is None:
                continue  # (the distributed optimizer: no part of it on this rank)
            dev = slot.leaf.device
            for k in STATES:
                st[k] = slot.mine(mine[k].to(dev)).to(slot.leaf.dtype).clone()
            st["step"] = torch.tensor(float(step))
            if slot.has_main():
                slot.leaf.copy_(slot.mine(mine["main"].to(dev)))
                if slot.leaf.shape == slot.p.shape:  # Megatron's Float16 optimizer: the model copy too
                    slot.p.data.copy_(slot.leaf.to(slot.p.dtype))
