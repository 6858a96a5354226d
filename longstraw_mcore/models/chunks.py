"""A rank's model chunks (parallel.vpp > 1: Megatron's interleaved stages, virtual stage v x pp + r is rank r's
chunk v) as one model for what takes a rank's whole model, and their DDP wrappers as one gradient holder.

    ModelChunks   a module over the chunks: parameters (named chunks.<v>.<the chunk's name>), the sharded
                  state dict (the chunks' together, each under chunks.<v>.: their tensors' checkpoint keys
                  are global, so a checkpoint is the same at any vpp), the model config and head, and
                  `adapters`: the chunks' adapter sets seen as one (checkpoints, PEFT export)
    DDPChunks     a list of the chunks' Megatron DDP wrappers (Megatron's optimizer, finalize_model_grads and
                  interleaved schedule take the list) with DDP's calls the trainer makes on one
    chunk_list    the chunks of a model, a ModelChunks or a list (one model: itself)

The replay engine and sampling run each chunk through Megatron's interleaved schedule (replay/pipeline.py);
each chunk keeps its own adapters (its layers', the output layer's on the last chunk).
"""

from __future__ import annotations

import torch


class ModelChunks(torch.nn.Module):
    def __init__(self, chunks: list):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        first = chunks[0]
        self.model_cfg, self.config, self.pg_collection = first.model_cfg, first.config, first.pg_collection
        self.head, self.vocab_size = first.head, first.vocab_size
        self.padded_vocab_size = first.padded_vocab_size

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self):
        return iter(self.chunks)

    def __getitem__(self, v: int):
        return self.chunks[v]

    @property
    def adapters(self):
        """The chunks' adapter sets as one (not registered: each chunk's holds its parameters), or None."""
        sets = [c.adapters for c in self.chunks if getattr(c, "adapters", None) is not None]
        if not sets:
            return None
        from longstraw_mcore.adapters.attach import AdapterSet

        merged = AdapterSet(sets[0].cfg, sets[0].sites)
        object.__setattr__(merged, "lora", {k: m for s in sets for k, m in s.lora.items()})
        merged.saved = {k: p for s in sets for k, p in s.saved.items()}
        merged.parallel = sets[0].parallel
        merged.padded_vocab = next((s.padded_vocab for s in sets if s.padded_vocab is not None), None)
        merged.base_bytes = None if sets[0].base_bytes is None else sum(s.base_bytes for s in sets)
        merged.switch = None  # (each chunk's own switch turns its adapters off: replay/steps.prompt_adapters)
        return merged

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        out = {}
        for v, c in enumerate(self.chunks):
            for k, t in c.sharded_state_dict(prefix, sharded_offsets, metadata).items():
                out[f"chunks.{v}.{k}"] = t
        return out

    def forward(self, *args, **kwargs):
        raise RuntimeError("ModelChunks: a rank's chunks run through Megatron's interleaved schedule "
                           "(replay/pipeline.py), not as one forward")


class DDPChunks(list):
    """The chunks' DDP wrappers; `module` is the ModelChunks."""

    def __init__(self, ddps: list, module: ModelChunks):
        super().__init__(ddps)
        self.module = module

    def zero_grad_buffer(self) -> None:
        for d in self:
            d.zero_grad_buffer()

    @property
    def buffers(self) -> list:
        return [b for d in self for b in d.buffers]

    @property
    def expert_parallel_buffers(self) -> list:
        return [b for d in self for b in d.expert_parallel_buffers]


def chunk_list(model) -> list:
    """This rank's model chunks: a list's or a ModelChunks' elements (a DDPChunks is a list), or [model]."""
    if isinstance(model, (list, ModelChunks)):
        return list(model)
    inner = getattr(model, "module", None)
    if isinstance(inner, ModelChunks):
        return list(inner)
    return [model]
