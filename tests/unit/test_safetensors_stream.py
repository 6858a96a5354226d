"""The streaming safetensors writer produces files the safetensors library reads back bit-exactly
(several dtypes, bf16 included); a tensor out of declared order is refused; an unfinished stream
leaves no file behind."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from longstraw_mcore.checkpoint.safetensors_stream import SafetensorsWriter


def test_round_trip_and_misuse(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(3, 5, generator=g, dtype=torch.float64),
               "b": torch.randn(7, generator=g).to(torch.bfloat16), "c": torch.randn(2, 2, 2, generator=g)}
    w = SafetensorsWriter(tmp_path / "x.safetensors", [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
    for k, t in tensors.items():
        w.write(k, t)
    w.close()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], t) for k, t in tensors.items())

    w = SafetensorsWriter(tmp_path / "y.safetensors", [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
    with pytest.raises(ValueError, match="expected a.weight"):
        w.write("b", tensors["b"])
    with pytest.raises(ValueError, match="1 declared tensors never written|3 declared tensors never written"):
        w.close()
    assert not (tmp_path / "y.safetensors").exists() and not list(tmp_path.glob(".y*"))
