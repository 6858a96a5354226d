"""Hugging Face PEFT adapter directories (`adapter_config.json` + `adapter_model.safetensors`), in and
out, and the whole (canonical) adapter tensors gathered from the ranks that hold their shards.

PEFT's names: `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], the
module named as in the Hugging Face model (`model.layers.3.mlp.gate_proj`; GLM's routed experts as
stored, `model.layers.3.mlp.experts.7.gate_proj`). Only plain LoRA is read: no DoRA, rsLoRA, bias,
per-module rank or alpha patterns, fan_in_fan_out; each is refused by name. A critic's directory (PEFT's
token-classification task) also keeps its value head whole: `base_model.model.score.weight` / `.bias`
(`modules_to_save`), read and written beside the factors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from longstraw_mcore.adapters.sites import Site
from longstraw_mcore.checkpoint.hf import write_dir_atomically
from longstraw_mcore.config import AdapterConfig, ConfigError

PREFIX = "base_model.model."
_REFUSED = {"use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False}
CRITIC_SAVED = "score"
"""The module a critic's adapter directory keeps whole (PEFT's token-classification task: modules_to_save),
as `base_model.model.score.weight` / `.bias`."""


CRITIC_SAVED_NAMES = (f"{CRITIC_SAVED}.weight", f"{CRITIC_SAVED}.bias")


def saved_shapes(m) -> dict[str, tuple[int, ...]]:
    """The whole tensors beside a critic's adapters (model config `m`): its token-value head's."""
    return dict(zip(CRITIC_SAVED_NAMES, ((1, m.hidden_size), (1,))))


def read_peft(path: str | Path, sites: list[Site], base: AdapterConfig,
              saved=(), load: bool = True) -> tuple[AdapterConfig, dict]:
    """A PEFT directory -> (the adapter section it describes, {module: (A, B)} in float64). `base`: the
    run's section (its base_dtype and prompt are kept; rank, alpha and targets come from the directory).
    `saved`: names of whole tensors a critic's directory may hold beside the factors (`saved_shapes`; read
    them with `read_saved`). `load` False: the same checks from the file's header alone, the factors
    returned as meta tensors (a config-time check). Raises ConfigError naming what does not match the
    model, before any model work."""
    from safetensors import safe_open

    d = Path(path)
    cfg_file, st = d / "adapter_config.json", d / "adapter_model.safetensors"
    for f in (cfg_file, st):
        if not f.is_file():
            raise ConfigError(f"--adapter {d}: no {f.name} (a PEFT adapter directory holds adapter_config.json and "
                              "adapter_model.safetensors)")
    raw = json.loads(cfg_file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{cfg_file}: peft_type={raw.get('peft_type')!r}; only LORA adapters are supported")
    for k, ok in _REFUSED.items():
        if raw.get(k, ok) not in (ok, None):
            raise ConfigError(f"{cfg_file}: {k}={raw[k]!r} is not supported (only {k}={ok!r})")
    for k in ("rank_pattern", "alpha_pattern"):
        if raw.get(k):
            raise ConfigError(f"{cfg_file}: {k}={raw[k]} (per-module rank/alpha) is not supported")
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    by_name = {s.name: s for s in sites}
    canonical: dict[str, list] = {}
    with safe_open(str(st), framework="pt") as fh:
        for key in fh.keys():
            if saved and key[len(PREFIX):] in saved:
                continue
            if not key.startswith(PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise ConfigError(f"{st}: tensor {key!r} is not a LoRA factor ({PREFIX}<module>.lora_A/B.weight)")
            name, factor = _module_and_factor(key)
            if name not in by_name:
                raise ConfigError(f"{st}: {key!r}: the model has no projection {name!r} an adapter can target "
                                  "(is this adapter for another base model?)")
            canonical.setdefault(name, [None, None])[factor] = _tensor(fh, key, load).to(torch.float64)
    if not canonical:
        raise ConfigError(f"{st}: holds no LoRA tensors")
    for name, (A, B) in canonical.items():
        out, n_in = by_name[name].shape
        if A is None or B is None:
            raise ConfigError(f"{st}: {name} has only one of lora_A / lora_B")
        if tuple(A.shape) != (r, n_in) or tuple(B.shape) != (out, r):
            raise ConfigError(f"{st}: {name}: lora_A {list(A.shape)}, lora_B {list(B.shape)}; the model's projection "
                              f"is [out={out}, in={n_in}] and the adapter's r={r}: expected lora_A [{r}, {n_in}], "
                              f"lora_B [{out}, {r}]")
    targets = sorted({by_name[n].target for n in canonical})
    partial = [n for n in by_name if by_name[n].target in targets and n not in canonical]
    if partial:
        raise ConfigError(f"{st}: targets {targets}, but {len(partial)} such modules have no tensors, e.g. "
                          f"{partial[:3]} (adapters on some layers only are not supported)")
    try:
        cfg = AdapterConfig(rank=r, alpha=float(alpha), targets=targets, base_dtype=base.base_dtype, prompt=base.prompt)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{cfg_file}: {e}") from None
    return cfg, {n: (A, B) for n, (A, B) in canonical.items()}


def _tensor(fh, key: str, load: bool) -> torch.Tensor:
    """A safetensors entry, or (`load` False) a meta tensor of its shape, read from the header alone."""
    return fh.get_tensor(key) if load else torch.empty(fh.get_slice(key).get_shape(), device="meta")


def read_saved(path: str | Path, shapes: dict[str, tuple[int, ...]], load: bool = True) -> dict[str, torch.Tensor]:
    """The whole tensors `shapes` names ({"score.weight": (1, H), ...}) from a PEFT directory, float64; those
    it lacks are left out (the model keeps its own). ConfigError on a shape that does not match. `load`
    False: meta tensors, from the header alone (read_peft's)."""
    from safetensors import safe_open

    st = Path(path) / "adapter_model.safetensors"
    out = {}
    with safe_open(str(st), framework="pt") as fh:
        for key in fh.keys():
            name = key[len(PREFIX):]
            if key.startswith(PREFIX) and name in shapes:
                t = _tensor(fh, key, load)
                if tuple(t.shape) != tuple(shapes[name]):
                    raise ConfigError(f"{st}: {key} is {list(t.shape)}; the critic's {name} is {list(shapes[name])}")
                out[name] = t.to(torch.float64)
    return out


LANGUAGE_MODEL = "model.language_model."
"""Where a multimodal transformers model (GLM-5.3-Flash's `Glm5NextForConditionalGeneration`) holds its decoder."""


def exclude_modules(modules) -> str | None:
    """PEFT's `exclude_modules` for an adapter on these modules: where every layer module sits in a multimodal
    model's language model (`model.language_model.`), every other module under `model.` (the vision tower, whose
    `gate_proj` / `up_proj` / `down_proj` the bare target names would also match), as a regex PEFT fully matches;
    else None."""
    layered = [n for n in modules if n != "lm_head"]
    if layered and all(n.startswith(LANGUAGE_MODEL) for n in layered):
        return r"model\.(?!language_model\.).*"
    return None


def peft_config(cfg: AdapterConfig, targets: list[str], base_model: str | None, saved: bool = False,
                exclude: str | None = None) -> dict:
    """adapter_config.json; `saved`: a critic's (PEFT's token-classification task, its `score` kept whole);
    `exclude`: PEFT's exclude_modules (`exclude_modules`)."""
    return {"peft_type": "LORA", "task_type": "TOKEN_CLS" if saved else "CAUSAL_LM", "r": cfg.rank,
            "lora_alpha": cfg.alpha, "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": [CRITIC_SAVED] if saved else None, "base_model_name_or_path": base_model,
            "inference_mode": True, **({"exclude_modules": exclude} if exclude else {})}


def write_peft(path: str | Path, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], cfg: AdapterConfig,
               targets: list[str], base_model: str | None = None, saved: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a PEFT directory atomically (a temporary sibling renamed into place); `saved`: the whole tensors
    beside the factors (a critic's value head: {"score.weight": ...})."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        flat = _flat(tensors)
        flat.update({PREFIX + n: t.contiguous() for n, t in (saved or {}).items()})
        save_file(flat, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config(cfg, targets, base_model, bool(saved),
                                                                        exclude_modules(tensors)), indent=2))

    return write_dir_atomically(path, fill, error=ConfigError)


def _flat(tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{module: (A, B)} -> PEFT's tensor names."""
    flat = {}
    for name, (A, B) in tensors.items():
        flat[f"{PREFIX}{name}.lora_A.weight"] = A.contiguous()
        flat[f"{PREFIX}{name}.lora_B.weight"] = B.contiguous()
    return flat


def _module_and_factor(key: str) -> tuple[str, int]:
    """`base_model.model.<module>.lora_A.weight` -> (module, 0); lora_B -> 1."""
    module, factor, _ = key[len(PREFIX):].rsplit(".", 2)
    return module, int(factor == "lora_B")


def _whole(t: torch.Tensor, dim: int, tp_group) -> torch.Tensor:
    import torch.distributed as dist

    if tp_group is None or tp_group.size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp_group.size())]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim)


def _value(p, grads: bool) -> torch.Tensor:
    """A parameter's value, or its gradient (DDP's main_grad where it has one; zeros where none came)."""
    g = p.main_grad if grads and hasattr(p, "main_grad") else (p.grad if grads else p.detach())
    return torch.zeros_like(p) if g is None else g.detach()


def _on_rank0(mine: dict) -> dict | None:
    """Every rank's `mine` merged on global rank 0 (None elsewhere). Collective."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    if dist.get_rank() != 0:
        return None
    out: dict = {}
    for d in every:
        out.update(d)
    return out


def gather_saved(aset, parallel, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """The modules that train whole beside the adapters (`AdapterSet.saved`: a critic's value head, held
    whole by every TP rank of the last stage), or their gradients, on global rank 0 (None elsewhere).
    Collective over the world."""
    own = parallel.pgs.tp.rank() == 0 and parallel.pgs.dp_cp.rank() == 0
    return _on_rank0({n: _value(p, grads).cpu() for n, p in aset.saved.items()} if own else {})


def gather_canonical(aset, parallel, grads: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """Every adapter's whole A and B (or their gradients) on global rank 0 (None elsewhere). Collective
    over the world: every rank calls it."""
    tp_group = parallel.pgs.tp
    mine = {}
    for name, lora in sorted(aset.items()):
        site = aset.sites[name]
        A = _value(lora.A, grads)
        if site.kind == "row":
            A = _whole(A, 1, tp_group)
        out = site.shape[0]
        B = torch.zeros(out, lora.rank, dtype=A.dtype)
        for i, part in enumerate(site.parts):
            b = _value(lora.B[str(i)], grads)
            if site.kind == "column":
                b = _whole(b, 0, tp_group)
            B[part.rows[0]:part.rows[1]] = b[:part.rows[1] - part.rows[0]].cpu()  # lm_head: the padded rows go
        # one holder of each whole tensor reports it: TP rank 0 of the first data x context parallel
        # replica; an expert's, the first of its expert-data-parallel replicas (experts are not TP-split)
        owner = parallel.pgs.expt_dp.rank() == 0 if site.kind == "expert" else \
            tp_group.rank() == 0 and parallel.pgs.dp_cp.rank() == 0
        if owner:
            mine[name] = (A.cpu(), B)
    out = _on_rank0(mine)
    if out is None:
        return None
    order = [s for s in aset.sites if s in out]
    return {n: out[n] for n in order}


def dump_grads(aset, path: str | Path, log=print) -> None:
    """The adapters' gradients (complete: after the step's reduction) as one safetensors file under PEFT's
    tensor names, written atomically by rank 0. Collective."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    grads = gather_canonical(aset, aset.parallel, grads=True)
    whole = gather_saved(aset, aset.parallel, grads=True)
    if dist.get_rank() != 0:
        return
    flat = _flat(grads)
    flat.update({PREFIX + n: t.contiguous() for n, t in whole.items()})
    dst = Path(path)
    tmp = dst.with_name(f".{dst.name}.tmp")
    save_file(flat, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dst)
    log(f"[validate] wrote the gradients of {len(grads)} adapters" + (f" and {', '.join(whole)}" if whole else "")
        + f" ({sum(t.numel() for t in flat.values()):,} values) to {dst} under PEFT's names")


def export_peft(src: str | Path, dst: str | Path, base_model: str | None = None, log=print) -> Path:
    """A standalone copy of a PEFT directory (a checkpoint's `adapter/`), naming `base_model` as its base."""
    from safetensors.torch import load_file

    s = Path(src)
    raw = json.loads((s / "adapter_config.json").read_text())
    tensors = load_file(str(s / "adapter_model.safetensors"))
    pairs, whole = {}, {}
    for key, t in tensors.items():
        if not key.endswith((".lora_A.weight", ".lora_B.weight")):  # a critic's value head, kept whole
            whole[key[len(PREFIX):]] = t
            continue
        name, factor = _module_and_factor(key)
        pairs.setdefault(name, [None, None])[factor] = t
    cfg = AdapterConfig(rank=raw["r"], alpha=float(raw["lora_alpha"]), targets=list(raw["target_modules"]))
    out = write_peft(dst, {k: tuple(v) for k, v in pairs.items()}, cfg, list(raw["target_modules"]),
                     base_model or raw.get("base_model_name_or_path"), saved=whole or None)
    log(f"[export] {out}: {len(pairs)} adapters (r={cfg.rank}, alpha={cfg.alpha:g})"
        + (f" and {', '.join(whole)}" if whole else ""))
    return out
