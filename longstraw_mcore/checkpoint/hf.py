"""Read and write Hugging Face Qwen3.5/3.6 directories (`config.json` + `*.safetensors`).

Accepted forms: the text-only `Qwen3_5ForCausalLM` (decoder under `model.*`) and the published
`Qwen3_5ForConditionalGeneration` (decoder under `model.language_model.*`, `text_config` nested,
plus a vision tower `model.visual.*` and `mtp.*` weights, which are skipped and reported). Written
directories are the text-only form. Writes go to a temporary sibling directory renamed into place,
so a failed write never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from longstraw_mcore.checkpoint.common import CheckpointError
from longstraw_mcore.config import ModelConfig

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
_TORCH_DTYPES = ("float32", "float64", "bfloat16", "float16")
_REQUIRED = ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim")


def read_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """`config.json` -> (ModelConfig, raw dict). Raises CheckpointError for other architectures."""
    d = Path(path)
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{d}: no config.json (expected a Hugging Face model directory)")
    raw = json.loads(cfg_file.read_text())
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise CheckpointError(f"{d}: architecture {archs or raw.get('model_type')!r} is not supported; "
                              f"expected one of {list(ARCHITECTURES)}")
    text = raw.get("text_config", raw)
    missing = [k for k in _REQUIRED if k not in text]
    if missing:
        where = "text_config" if "text_config" in raw else "config.json"
        raise CheckpointError(f"{cfg_file}: {where} lacks required field(s) {missing}")
    if text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)):
        raise CheckpointError(f"{d}: tie_word_embeddings=true; the Qwen3.6 family has an untied lm_head")
    n = text["num_hidden_layers"]
    types = text.get("layer_types")
    interval = text.get("full_attention_interval", 4)
    if types is not None:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        if not full or any(t not in ("full_attention", "linear_attention") for t in types):
            raise CheckpointError(f"{d}: layer_types {types} is not a Gated DeltaNet / full attention pattern")
        interval = full[0] + 1
        regular = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        if types != regular:
            raise CheckpointError(f"{d}: layer_types is not periodic (every {interval}th layer full attention); "
                                  "irregular layer patterns are not supported")
    rope = text.get("rope_parameters") or {}
    dtype = str(text.get("dtype", text.get("torch_dtype", raw.get("dtype", raw.get("torch_dtype", "bfloat16")))))
    dtype = dtype.removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise CheckpointError(f"{cfg_file}: dtype {dtype!r} is not one of {list(_TORCH_DTYPES)}")
    m = ModelConfig(
        family="qwen3_5", vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_layers=n, full_attention_interval=interval,
        num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
        head_dim=text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
        linear_num_key_heads=text["linear_num_key_heads"], linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"], linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4), rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        dtype=dtype,
    )
    return m, raw


def _text_key(key: str) -> str | None:
    """Map a checkpoint key to its `Qwen3_5ForCausalLM` name, or None if it is not the text decoder."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith(("model.visual.", "mtp.", "model.mtp.")):
        return None
    return key


class SafetensorsDir(Mapping):
    """The text-decoder tensors of an HF directory under their `Qwen3_5ForCausalLM` names, read on
    access (one tensor at a time), or only a slice of one (`read`: a TP rank reads its shard);
    shapes come from the file headers without reading data. `bytes_read` counts what was read."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        d = Path(path)
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no *.safetensors files")
        self._where: dict[str, tuple[str, str]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.skipped: list[str] = []
        self.bytes_read = 0
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    name = _text_key(key)
                    if name is None:
                        self.skipped.append(key)
                        continue
                    self._where[name] = (str(f), key)
                    self._shapes[name] = tuple(fh.get_slice(key).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f, key = self._where[name]
        with safe_open(f, framework="pt") as fh:
            t = fh.get_tensor(key)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read(self, name: str, sl: tuple[slice, ...]) -> torch.Tensor:
        """Only `tensor[sl]` of `name` (contiguous slices per dimension) is read from disk."""
        from safetensors import safe_open

        f, key = self._where[name]
        with safe_open(f, framework="pt") as fh:
            t = fh.get_slice(key)[tuple(sl)]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_tensors(path: str | Path) -> tuple[SafetensorsDir, list[str]]:
    """The text-decoder tensors of an HF directory (lazy, CausalLM names) and the skipped keys."""
    tensors = SafetensorsDir(path)
    return tensors, tensors.skipped


def hf_config_dict(m: ModelConfig) -> dict:
    """A `Qwen3_5ForCausalLM` config.json for this model."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim, "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": False, "attention_bias": False,
        "layer_types": m.layer_types, "full_attention_interval": m.full_attention_interval,
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim, "linear_key_head_dim": m.linear_key_head_dim,
        "linear_value_head_dim": m.linear_value_head_dim, "linear_num_key_heads": m.linear_num_key_heads,
        "linear_num_value_heads": m.linear_num_value_heads, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                            "partial_rotary_factor": m.partial_rotary_factor},
        "dtype": m.dtype,
    }


def _config_for(m) -> dict:
    if m.family == "qwen3_5":
        return hf_config_dict(m)
    from longstraw_mcore.families import get_family

    return get_family(m.family).mapping.hf_config_dict(m)


def write_hf(path: str | Path, tensors: dict[str, torch.Tensor], m, config: dict | None = None) -> Path:
    """Write config.json (`config`, or one made from `m` by its family) + model.safetensors atomically
    (temp dir, then rename). Refuses to overwrite a non-empty directory."""
    from safetensors.torch import save_file

    dst = Path(path)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst}: exists and is not empty; refusing to overwrite")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp", dir=dst.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config if config is not None else _config_for(m), indent=2))
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
