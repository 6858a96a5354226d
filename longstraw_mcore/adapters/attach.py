"""Put adapters on a built model: freeze the base, build this rank's LoRA shards for the sites the run
targets (its pipeline stage's layers, its experts), hook them onto the base projections.

The adapters sit in `model.adapters` (an `AdapterSet`, so DDP, the optimizer and checkpoints find
them as the model's only trainable parameters), keyed by their Hugging Face module names. Canonical
(whole, unsharded) adapter tensors come in from a PEFT directory (adapters/peft_io.py) or are drawn
as PEFT draws a new adapter (A kaiming-uniform, B = 0), the same at every layout.
"""

from __future__ import annotations

import contextlib

import torch

from longstraw_mcore.adapters.lora import LoRA, Slot, Switch, adapter_hook, init_a
from longstraw_mcore.adapters.sites import Site
from longstraw_mcore.config import AdapterConfig, ConfigError


def _key(name: str) -> str:
    return name.replace(".", "__")


class AdapterSet(torch.nn.Module):
    """This rank's adapters (`lora[name]`), the sites they came from, and their shared on/off switch."""

    def __init__(self, cfg: AdapterConfig, sites: dict[str, Site]):
        super().__init__()
        self.cfg, self.sites, self.switch = cfg, sites, Switch()
        self.base_bytes = None  # the quantized base's bytes on this rank (adapter.base_dtype nf4 / fp8)
        self.lora = torch.nn.ModuleDict()
        # modules that train whole beside the adapters (PEFT's modules_to_save): a critic's value head, on the
        # last pipeline stage, {Hugging Face name: parameter} (not registered here: they stay the model's)
        self.saved: dict[str, torch.nn.Parameter] = {}

    def items(self):
        return ((m.name, m) for m in self.lora.values())

    @contextlib.contextmanager
    def disabled(self):
        """The base model alone inside the block (adapter.prompt=frozen's prompt positions)."""
        was, self.switch.on = self.switch.on, False
        try:
            yield
        finally:
            self.switch.on = was

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters()) + sum(p.numel() for p in self.saved.values())


def adapter_set(model) -> AdapterSet | None:
    """The model's adapters (through a DDP wrapper too), or None for full-parameter training."""
    inner = getattr(model, "module", model)
    return getattr(inner, "adapters", None)


def _local_path(path: str, first_layer: int, site: Site, experts_per_rank: int, ep_rank: int) -> str | None:
    """A site part's module path (global layer and expert numbers) -> this rank's, or None if another
    pipeline stage or EP rank holds it."""
    parts = path.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) - first_layer)
    if site.expert is not None:
        j = site.expert - ep_rank * experts_per_rank
        if not 0 <= j < experts_per_rank:
            return None
        parts[parts.index("local_experts") + 1] = str(j)
    return ".".join(parts)


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def attach(model, sites: list[Site], cfg: AdapterConfig, parallel, seed: int, canonical: dict | None = None,
           padded_vocab: int | None = None, saved: dict | None = None, vp_stage: int | None = None) -> AdapterSet:
    """Freeze `model`'s base and add the adapters of `cfg`'s targets that live on this rank. `canonical`:
    {name: (A [r, in], B [out, r])} whole tensors (a PEFT directory's), or None for a new adapter. A model
    with a scalar head (a critic) keeps that head trainable (`AdapterSet.saved`); `saved`: its whole
    tensors from a PEFT directory ({"score.weight": ...}), or None to keep the model's. `vp_stage`: the model
    chunk `model` is at parallel.vpp > 1 (each chunk has its own adapters: its layers', the output layer's on
    the last)."""
    from longstraw_mcore.checkpoint.heads import head_of_model
    from longstraw_mcore.models.language_model import stage_range

    targets = set(cfg.resolved_targets({s.target: s.shape for s in sites}))
    chosen = [s for s in sites if s.target in targets]
    if canonical is not None:
        missing = [s.name for s in chosen if s.name not in canonical]
        if missing:
            raise ConfigError(f"adapter: the adapter has no tensors for {len(missing)} targeted modules, e.g. "
                              f"{missing[:3]}")
    for p in model.parameters():
        p.requires_grad_(False)
    layers = stage_range(parallel, vp_stage)
    last = model.post_process  # (the last stage's, or at vpp > 1 its last chunk's)
    tp, tp_rank = parallel.tp, parallel.pgs.tp.rank()
    ep, ep_rank = parallel.ep, (parallel.pgs.ep.rank() if parallel.ep > 1 else 0)
    m = model.model_cfg
    per_rank = getattr(m, "n_routed_experts", 0) // ep
    first = next(model.parameters())
    dtype, device = first.dtype, first.device  # the adapters live where the model does
    # KV groups (parallel/kv_group.py) hold a GQA attention's k/v projections past its KV heads; a family without
    # KV heads (GLM-5.3's k_proj / v_proj are KDA's, column parallel by heads) has none to refuse
    if parallel.tp_kv is not None and hasattr(m, "num_key_value_heads") and targets & {"k_proj", "v_proj"}:
        raise ConfigError(f"adapter.targets {sorted(targets & {'k_proj', 'v_proj'})} with parallel.tp={tp} above "
                          f"model.num_key_value_heads={m.num_key_value_heads} (KV groups): not supported yet; "
                          "leave them out of adapter.targets or use parallel.tp <= the KV heads")
    aset = AdapterSet(cfg, {s.name: s for s in chosen})
    if head_of_model(model) != "lm" and last:
        for n, p in model.output_layer.named_parameters():
            p.requires_grad_(True)
            aset.saved[f"score.{n}"] = p
    modules = dict(model.named_modules())
    if cfg.base_dtype != "bfloat16":
        aset.base_bytes = _quantize_base(model, modules, sites, cfg.base_dtype, layers, per_rank, ep_rank, parallel)
    hooks: dict[str, list[Slot]] = {}
    pieces: dict[str, int] = {}
    for s in chosen:
        if s.layer is None:
            if not last:
                continue
        elif s.layer not in layers:
            continue
        paths = [_local_path(p.module, layers.start, s, per_rank, ep_rank) for p in s.parts]
        if any(p is None for p in paths):
            continue
        out, n_in = s.shape
        if canonical is not None:
            A, B = canonical[s.name]
        else:
            A, B = init_a(s.name, cfg.rank, n_in, seed), torch.zeros(out, cfg.rank, dtype=torch.float64)
        A, parts = local_factors(s, A, B, tp_rank, tp, padded_vocab)
        lora = LoRA(s.name, A.to(device, dtype), {k: v.to(device, dtype) for k, v in parts.items()}, cfg.scale,
                    s.kind, aset.switch)
        aset.lora[_key(s.name)] = lora
        for i, (part, path) in enumerate(zip(s.parts, paths)):
            if path not in modules:
                raise RuntimeError(f"adapter site {s.name}: no module {path} in the model")
            hooks.setdefault(path, []).append(Slot(lora, str(i), part.slot))
            pieces[path] = len(part.fused) if part.fused else 1
    for path, slots in hooks.items():
        slots = sorted(slots, key=lambda sl: sl.index)
        linear = modules[path]
        linear.adapter_slots = slots
        if _absorbed(path):
            continue  # the mixer reads effective_weight(linear)
        linear.register_forward_hook(adapter_hook(slots, pieces[path]))
    aset.parallel, aset.padded_vocab = parallel, padded_vocab
    model.adapters = aset
    if saved:
        load_saved(aset, saved)
    return aset


def local_factors(s: Site, A: torch.Tensor, B: torch.Tensor, tp_rank: int, tp: int, padded_vocab: int | None):
    """This TP rank's shard of a whole adapter: (A, {part: its rows of B}) (adapters/lora.py's table)."""
    if s.kind == "row" and tp > 1:
        A = _shard(A, 1, tp_rank, tp)
    parts = {}
    for i, part in enumerate(s.parts):
        b = B[part.rows[0]:part.rows[1]]
        if s.name == "lm_head" and padded_vocab is not None and padded_vocab > b.shape[0]:
            b = torch.cat([b, b.new_zeros(padded_vocab - b.shape[0], b.shape[1])])
        if s.kind == "column" and tp > 1:
            b = _shard(b, 0, tp_rank, tp)
        parts[str(i)] = b.contiguous()
    return A.contiguous(), parts


@torch.no_grad()
def load_saved(aset: AdapterSet, saved: dict) -> None:
    """Overwrite the modules that train whole (a critic's value head) with `saved`'s tensors, where this rank
    holds them; their names were checked against the model when the directory was read."""
    for name, p in aset.saved.items():
        if name in saved:
            p.copy_(saved[name].reshape(p.shape))


@torch.no_grad()
def load_canonical(aset: AdapterSet, canonical: dict, saved: dict | None = None) -> None:
    """Overwrite this rank's adapter shards with whole tensors ({name: (A, B)}, e.g. a checkpoint's), and
    the modules that train whole with `saved`'s."""
    par = aset.parallel
    missing = [n for n, _ in aset.items() if n not in canonical]
    if missing:
        raise ConfigError(f"adapter: no tensors for {missing[:3]} ({len(missing)} modules)")
    for name, lora in aset.items():
        A, parts = local_factors(aset.sites[name], *canonical[name], par.pgs.tp.rank(), par.tp, aset.padded_vocab)
        if A.shape != lora.A.shape:
            raise ConfigError(f"adapter {name}: lora_A {list(A.shape)} does not match this run's {list(lora.A.shape)}")
        lora.A.copy_(A)
        for k, b in parts.items():
            lora.B[k].copy_(b)
    if saved:
        load_saved(aset, saved)


def _quantize_base(model, modules, sites, kind, layers, per_rank, ep_rank, parallel) -> int:
    """QLoRA: every projection of this rank's layers stored quantized (adapters/quant.py), the output
    layer and the embedding kept; returns the quantized bytes."""
    from longstraw_mcore.adapters.quant import quantize

    total, done = 0, set()
    for s in sites:
        if s.layer is None or s.layer not in layers:
            continue
        for part in s.parts:
            path = _local_path(part.module, layers.start, s, per_rank, ep_rank)
            if path is None or path in done or not hasattr(modules.get(path), "_forward_impl"):
                continue  # another rank's expert; a KV-group projection (parallel/kv_group.py) stays dense
            done.add(path)
            total += quantize(modules[path], kind, path)
    return total


def _absorbed(path: str) -> bool:
    """Projections whose weight a mixer uses directly instead of calling them (MLA's kv_b_proj)."""
    return path.endswith("kv_b_proj")
