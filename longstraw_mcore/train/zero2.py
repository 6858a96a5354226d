"""Gradients reduced per micro-step and kept as shards (ZeRO-2 over data x context parallel ranks).

Megatron DDP keeps a full-size gradient buffer on every rank for the whole step (measured:
../shared/notes/mcore-ddp-cpu.md); a 27B model's is 108 GB in float32, which no rank can hold beside
a million-token prompt state. Here the replay engine calls `micro_step_done()` after every backward
(each branch or branch batch, each exact-mode chunk): every parameter's gradient is reduce-scattered
over the DP x CP group, averaged, added into this rank's shard, and the full-size `.grad` is freed.
Between micro-steps no rank holds a full gradient, only its 1/N shard (N = |DP x CP|); during one,
autograd's `.grad` of that micro-step alone (in the model dtype).

Lockstep: a reduce-scatter is collective, but DP ranks replay different prompt groups, so they run
different numbers of micro-steps. Every reduction round therefore starts with a one-number all-reduce
(max) of "I have a micro-step to reduce"; a rank whose work for the step is done joins rounds with
zeros (`finish()`) until a round where nobody has work. Every rank then runs the same rounds.
(Reducing each parameter as soon as autograd completes it, which would bound the transient to one
parameter, needs every rank to run structurally identical backward graphs in the same order; ranks
with different prompt groups do not.)

Shards: parameter p (n elements) is flattened and cut into N equal pieces (padded); rank i owns piece
i of every parameter, its master copy and gradient shard (float32; float64 for a float64 model) and
Adam's moments (torch.optim.AdamW over the master shards, as Megatron's optimizer falls back to
without Apex/TE). Step: global gradient norm from the shards (summed over DP x CP and the
model-parallel groups, TP-replicated parameters counted once), clipping, AdamW on the shards, then
every parameter all-gathered from its shards into the model (cast to the model dtype).

memory.grad_offload (memory/grad_stage.py): each parameter's gradient goes to a host buffer as soon as
autograd completes it, so no full-size gradient is on the device even within a micro-step; a round
then builds one bucket's send buffer on the device at a time from the host copies, and the shards
(and the optimizer's reads of them) are in host memory. The values reduced are the same, so the
result is bit-identical.

The averaging is the same as Megatron DDP's (1/N): replicated contributions (a branch replayed on
every CP rank) stay as they are, partial ones (a CP rank's share of a recomputed chunk) are scaled
by CP where they arise (prompt_state/contexts.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from longstraw_mcore.parallel.reduce import all_reduce_max, all_reduce_sum, model_parallel_sum


def _owned(p) -> bool:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    return param_is_not_tensor_parallel_duplicate(p)


class ShardedGradients:
    """The model's parameters with gradient shards fed per micro-step (see the module docstring).

    Parameters are reduced in buckets of about `bucket_mib` (one reduce-scatter each): a bucket's send
    buffer holds, for every rank i in turn, piece i of each of its parameters, so rank i's result is
    its shard of all of them, back to back (`self.grad[p]` are views into it)."""

    def __init__(self, model, group, par, bucket_mib: float = 64.0, offload: bool = False, expert_group=None):
        """`group`: data x context parallel; `expert_group`: expert data parallel, where routed experts
        (Megatron's `allreduce = False` parameters: each EP rank holds other experts) are reduced, as
        Megatron DDP reduces them, then scaled by 1 / |group| like the rest (their tokens came from
        every data-parallel rank through the all-to-all)."""
        self.module, self.group, self.par, self.expert_group = model, group, par, expert_group
        self.n, self.rank = group.size(), group.rank()
        self.params = [p for p in model.parameters() if p.requires_grad]
        experts = [p for p in self.params if not getattr(p, "allreduce", True)]
        if experts and expert_group is None:
            raise ValueError("routed expert parameters need their expert data parallel group")
        self.group_of = {p: expert_group if not getattr(p, "allreduce", True) else group for p in self.params}
        self.per = {p: -(-p.numel() // self.group_of[p].size()) for p in self.params}
        dev = par.device
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        elt = torch.empty(0, dtype=self.dtype).element_size()
        self.buckets, self.bucket_group, cur, size = [], [], [], 0
        for members in ([p for p in self.params if self.group_of[p] is group], experts):
            for p in members:
                cur.append(p)
                size += self.per[p] * self.group_of[p].size() * elt
                if size >= bucket_mib * 2**20:
                    self.buckets.append(cur)
                    cur, size = [], 0
            if cur:
                self.buckets.append(cur)
                cur, size = [], 0
        self.bucket_group = [self.group_of[b[0]] for b in self.buckets]
        self.stage = None
        home = dev
        if offload:  # memory.grad_offload: this micro-step's gradients and the shards in host memory
            from longstraw_mcore.memory.grad_stage import HostGradStage

            self.stage, home = HostGradStage(self.params, dev), torch.device("cpu")
        pin = offload and dev.type == "cuda"
        self.shard = [torch.zeros(sum(self.per[p] for p in b), dtype=self.dtype, device=home, pin_memory=pin)
                      for b in self.buckets]
        self.grad = {}
        for b, flat in zip(self.buckets, self.shard):
            views = torch.split(flat, [self.per[p] for p in b])
            self.grad.update(zip(b, views))
        self.main = {p: self.piece(p, p.detach().to(self.dtype)).clone() for p in self.params}
        self.rounds = 0
        # gloo (CPU): an in-place all-reduce, then this rank's row. Gloo's reduce_scatter_tensor copies the
        # whole send buffer and often frees the copy on its worker thread (measured: 1 MiB of send left a
        # 2 MiB peak), which the CPU memory profiler cannot see; twice the bytes on the wire does not
        # matter on the CPU test backend. NCCL: reduce_scatter_tensor, which allocates nothing.
        self.gloo = dist.get_backend(group) == "gloo"

    def piece(self, p, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `full` (shaped like parameter p): its flat, padded slice in p's group."""
        g = self.group_of[p]
        n, rank = g.size(), g.rank()
        p_flat = full.reshape(-1)
        per = -(-p_flat.numel() // n)
        padded = torch.zeros(per * n, dtype=p_flat.dtype, device=p_flat.device)
        padded[:p_flat.numel()] = p_flat
        return padded[rank * per:(rank + 1) * per]

    def whole(self, p, piece: torch.Tensor) -> torch.Tensor:
        """Parameter p's tensor from every rank's piece (collective over p's group), shaped like p."""
        g = self.group_of[p]
        if g.size() > 1:
            full = torch.empty(piece.numel() * g.size(), dtype=piece.dtype, device=piece.device)
            dist.all_gather_into_tensor(full, piece.contiguous(), group=g)
        else:
            full = piece
        return full[:p.numel()].view(p.shape)

    def micro_step_done(self) -> None:
        """After a backward: reduce-scatter this micro-step's gradients into the shards, free them."""
        self._round(True)

    def finish(self) -> None:
        """This rank's micro-steps of the step are done: join the other ranks' rounds until none is left."""
        while self._round(False):
            pass

    @torch.no_grad()
    def _round(self, mine: bool) -> bool:
        if self.n > 1 and all_reduce_max([1.0 if mine else 0.0], self.group, self.par.device)[0] == 0.0:
            return False  # nobody has a micro-step left
        if self.n == 1 and not mine:
            return False
        self.rounds += 1
        if self.stage is not None:
            self.stage.ready()
        for b, shard, group in zip(self.buckets, self.shard, self.bucket_group):
            width, n = shard.numel(), group.size()
            send, out = self._bucket_buffers(width, n)
            col = 0
            for p in b:
                per = self.per[p]
                g = self._take(p)
                if g is not None:
                    flat = g.detach().reshape(-1).to(send.device, non_blocking=True).to(self.dtype)
                    for i in range(n):  # piece i of p goes to rank i's part of the buffer
                        piece = flat[i * per:(i + 1) * per]
                        send[i, col:col + piece.numel()] = piece
                col += per
            if n > 1:
                if self.gloo:  # (gloo's reduce-scatter copies the whole send buffer inside: see __init__)
                    dist.all_reduce(send, group=group)
                    out.copy_(send[group.rank()])
                else:
                    dist.reduce_scatter_tensor(out, send.reshape(-1), group=group)
                shard.add_(out.to(shard.device), alpha=1.0 / self.n)
            elif self.n > 1:  # (experts at expert data parallel 1: still 1 / |data x context parallel|)
                shard.add_(send[0].to(shard.device), alpha=1.0 / self.n)
            else:
                shard.add_(send[0].to(shard.device))
        if self.stage is not None:
            self.stage.clear()
        return True

    def _bucket_buffers(self, width: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A bucket's send buffer [n, width] (zeroed) and reduce-scatter output [width]: views into two
        buffers of the largest bucket's size, made at the first round and kept (a buffer made per bucket
        is often released by gloo's worker thread when its collective completes, not by this one)."""
        if not hasattr(self, "_send"):
            sizes = [(s.numel() * g.size(), s.numel()) for s, g in zip(self.shard, self.bucket_group)]
            self._send = torch.empty(max(a for a, _ in sizes), dtype=self.dtype, device=self.par.device)
            self._out = torch.empty(max(b for _, b in sizes), dtype=self.dtype, device=self.par.device)
        send = self._send[:n * width].view(n, width)
        send.zero_()
        return send, self._out[:width]

    def _take(self, p) -> torch.Tensor | None:
        """p's gradient of this micro-step (host-staged or autograd's `.grad`, which is freed here)."""
        if self.stage is not None:
            return self.stage.take(p)
        g, p.grad = p.grad, None  # this micro-step's full-size gradient of p is freed after its bucket
        return g

    def zero_grad_buffer(self) -> None:
        for flat in self.shard:
            flat.zero_()

    def host_bytes(self) -> int:
        """memory.grad_offload: the host-resident gradient bytes (the staging buffers and the shards)."""
        if self.stage is None:
            return 0
        return self.stage.nbytes() + sum(g.numel() * g.element_size() for g in self.shard)

    def grad_bytes(self) -> int:
        """Bytes of gradient this rank holds now: its shards plus any full-size `.grad` left."""
        shard = sum(g.numel() * g.element_size() for g in self.shard)
        full = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        return shard + full


class ShardedAdam:
    """AdamW on the master shards of `ShardedGradients`; `step()` -> (ok, grad norm, None)."""

    def __init__(self, sharded: ShardedGradients, lr: float, betas, eps: float, weight_decay: float, clip_grad: float,
                 offload: bool = False):
        self.s = sharded
        # memory.optimizer_offload: the master shards (and so AdamW's moments, made like them) in host
        # memory, the update on the CPU; the gradient shards stay where the reduce-scatter writes them
        self.offload = offload
        if offload:
            pin = sharded.par.device.type == "cuda"
            for p in sharded.params:
                sharded.main[p] = sharded.main[p].to("cpu").pin_memory() if pin else sharded.main[p].to("cpu")
        self.leaves = [sharded.main[p].requires_grad_(False) for p in sharded.params]
        # as Megatron's optimizer: no weight decay on 1-D parameters (norms, A_log, dt_bias)
        decay = [leaf for p, leaf in zip(sharded.params, self.leaves) if p.dim() > 1]
        no_decay = [leaf for p, leaf in zip(sharded.params, self.leaves) if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=lr, betas=betas, eps=eps)
        self.clip_grad = clip_grad

    def zero_grad(self) -> None:
        self.s.zero_grad_buffer()

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The whole model's gradient norm from the shards: each parameter's squares summed over its
        shards' group; then the other parameters over tensor and pipeline parallel (TP-replicated ones
        counted once), the routed experts over expert and pipeline parallel (each EP rank's are others)."""
        s = self.s
        dense = sum(float(s.grad[p].double().pow(2).sum()) for p in s.params if s.group_of[p] is s.group and _owned(p))
        expert = sum(float(s.grad[p].double().pow(2).sum()) for p in s.params if s.group_of[p] is not s.group)
        dense = model_parallel_sum(all_reduce_sum([dense], s.group, s.par.device), s.par)[0]
        if any(s.group_of[p] is not s.group for p in s.params) or s.par.ep > 1:
            expert = all_reduce_sum([expert], s.expert_group, s.par.device)[0]
            expert = all_reduce_sum([expert], s.par.pgs.ep, s.par.device)[0]
            expert = all_reduce_sum([expert], s.par.pgs.pp, s.par.device)[0] if s.par.pp > 1 else expert
        return (dense + expert) ** 0.5

    @torch.no_grad()
    def step(self):
        s = self.s
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return False, norm, None
        coeff = min(1.0, self.clip_grad / (norm + 1e-6)) if self.clip_grad > 0 else 1.0
        for p, leaf in zip(s.params, self.leaves):
            leaf.grad = (s.grad[p] * coeff).to(leaf.device)
        self.optimizer.step()
        for p, leaf in zip(s.params, self.leaves):
            leaf.grad = None
            # (the host shard back to the device: NCCL gathers device tensors)
            p.data.copy_(s.whole(p, leaf.to(p.device)).to(p.dtype))
        return True, norm, None

    def reload_model_params(self) -> None:
        """Master shards from the model's parameters (after loading a checkpoint)."""
        for p, leaf in zip(self.s.params, self.leaves):
            leaf.copy_(self.s.piece(p, p.detach().to(self.s.dtype)))

    def extra_state(self) -> dict:
        """What a resume needs besides AdamW's state: the float32 master shards (bf16 models)."""
        return {"main_shards": [leaf.detach().clone() for leaf in self.leaves]}

    def load_extra_state(self, state: dict) -> None:
        for leaf, saved in zip(self.leaves, state["main_shards"], strict=True):
            leaf.copy_(saved)

