"""Bring up torch.distributed and Megatron's model-parallel groups for a `RunConfig`.

`setup_parallel(cfg)` checks the layout against the world size *before* creating any group, applies
the CPU patches when the device is `cpu`, initialises Megatron's groups (order tp-cp-ep-dp-pp), seeds
the model-parallel RNG, and returns the `ProcessGroupCollection` that every module receives
explicitly. Under torchrun the default group is created from the environment (gloo on CPU, NCCL on
CUDA); inside `launch_local.run_ranks` it already exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longstraw_mcore import cpu_compat
from longstraw_mcore.config import RunConfig
from longstraw_mcore.parallel.kv_group import new_kv_groups
from longstraw_mcore.parallel.timeout import dist_timeout, rendezvous_timeout


@dataclass
class Parallel:
    """What a rank knows about the layout: its process groups and coordinates."""

    pgs: object  # megatron.core.process_groups_config.ProcessGroupCollection
    device: torch.device
    tp: int
    pp: int
    cp: int
    dp: int
    rank: int
    world_size: int
    stage_layers: list  # decoder layers per pipeline stage (ParallelConfig.stage_layers)
    ep: int = 1  # expert parallel size (carved out of dp, as Megatron does)
    vpp: int = 1  # model chunks per pipeline rank (ParallelConfig.vpp)
    virtual_layers: list | None = None  # decoder layers per virtual stage at vpp > 1, in the data's order
    tp_kv: object = None
    """This rank's KV group (parallel/kv_group.py) when tp exceeds the heads the prompt state is split by
    (`model.state_heads`: Qwen's KV heads; one for GLM's latent, so the whole TP group at tp > 1)."""
    lockstep: object = None
    """The ranks that run a prompt group's plan step by step together (`lockstep_group`); None: this
    rank alone."""

    @property
    def tp_rank(self) -> int:
        return self.pgs.tp.rank()

    @property
    def pp_rank(self) -> int:
        return self.pgs.pp.rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def layout(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "dp": self.dp,
                "world_size": self.world_size}


def init_distributed(device: str) -> None:
    """Create the default process group from torchrun's environment if none exists."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # a plain `python` launch: one rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from longstraw_mcore.launch_local import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=dist_timeout())
    from longstraw_mcore.parallel import peers

    # heartbeats: a failed collective can then name the node that went away (cli.py); its connections wait
    # as long as the rendezvous did, so a store slowed by many ranks or a loaded machine never fails the run
    peers.start(rendezvous_timeout(backend))


def setup_parallel(cfg: RunConfig) -> Parallel:
    device = cfg.resolved_device()
    world = int(os.environ["WORLD_SIZE"]) if not dist.is_initialized() and "WORLD_SIZE" in os.environ else None
    if world is not None:
        cfg.parallel.dp_for(world)  # fail before creating any group
    cpu_compat.enable(device)
    init_distributed(device)
    world = dist.get_world_size()
    p = cfg.parallel
    dp = p.dp_for(world)
    stages = p.stage_layers(cfg.model.num_layers)  # before any group: the pipeline split adds up

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # experts are not split by TP (expert tensor parallel 1: each EP rank holds whole experts), the
    # usual choice for fine-grained MoE; with it the dispatcher needs no uneven all-gathers
    timeout = dist_timeout()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                             context_parallel_size=p.cp, expert_model_parallel_size=p.ep,
                                             expert_tensor_parallel_size=1,
                                             **({} if timeout is None else
                                                {"distributed_timeout_minutes": timeout.total_seconds() / 60}))
    # Megatron reads the virtual pipeline size from its global state where it numbers a chunk's layers
    # (PipelineParallelLayerLayout.get_layer_offset), whatever process groups a module is given
    parallel_state.set_virtual_pipeline_model_parallel_world_size(p.vpp if p.vpp > 1 else None)
    torch.manual_seed(cfg.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    # tp > the state's heads: the TP ranks sharing one head form a KV group (parallel/kv_group.py)
    tp_kv = new_kv_groups(pgs.tp, cfg.model.state_heads)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return Parallel(pgs=pgs, device=dev, tp=p.tp, pp=p.pp, cp=p.cp, dp=dp, rank=dist.get_rank(), world_size=world,
                    stage_layers=stages, ep=p.ep, tp_kv=tp_kv, lockstep=lockstep_group(pgs), vpp=p.vpp,
                    virtual_layers=p.virtual_stage_layers(cfg.model.num_layers) if p.vpp > 1 else None)


def lockstep_group(pgs):
    """The process group of the ranks that run each step of a prompt group's plan together: those
    joined, directly or through others, by a tensor-, context-, pipeline- or expert-parallel group (a
    collective inside a step needs every rank of its group; under EP the data-parallel ranks of an EP
    group replay in lockstep, replay/engine.py). Data-parallel ranks outside each other's EP groups run
    different prompt groups, with different numbers of steps, and meet only at the step's end. Every
    rank creates every component's group, in the same order (new_group is collective); None when this
    rank's component is itself alone, the world group when it is everyone."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = {rank}
    for name in ("tp", "cp", "pp", "ep"):
        g = getattr(pgs, name, None)
        if g is not None and g.size() > 1:
            mine |= set(dist.get_process_group_ranks(g))
    every = [None] * world
    dist.all_gather_object(every, sorted(mine))
    root = list(range(world))

    def find(r):
        while root[r] != r:
            root[r] = root[root[r]]
            r = root[r]
        return r
    for ranks in every:
        for r in ranks[1:]:
            root[find(r)] = find(ranks[0])
    components = sorted({tuple(r for r in range(world) if find(r) == find(x)) for x in range(world)})
    if len(components) == 1:
        return dist.group.WORLD if world > 1 else None
    out = None
    for comp in components:
        g = dist.new_group(list(comp), timeout=dist_timeout())
        if rank in comp and len(comp) > 1:
            out = g
    return out


def replica_group(pgs):
    """(group, leader's global rank) of the ranks that hold one model replica: those of this rank's
    data-parallel index (its tensor-, context- and pipeline-parallel peers). User code (rewards,
    environments: tasks/text_task.py) runs on the leader and its results are broadcast here, so every
    rank of a replica trains on the same numbers even when a call times out. Every rank creates every
    replica's group, in the same order (new_group is collective); group None when the replica is one rank."""
    world = dist.get_world_size()
    every = [None] * world
    dist.all_gather_object(every, pgs.dp.rank())
    mine, group = every[dist.get_rank()], None
    for d in sorted(set(every)):
        ranks = [r for r in range(world) if every[r] == d]
        if len(ranks) > 1:
            g = dist.new_group(ranks, timeout=dist_timeout())
            if d == mine:
                group = g
    return group, min(r for r in range(world) if every[r] == mine)
