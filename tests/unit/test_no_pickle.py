"""checkpoint/no_pickle.py: what a checkpoint directory holds is read as data, never run (issue 57).

torch.distributed.checkpoint directories written here in one process (`no_dist`), as Megatron's are: a plain
one reads; one whose byte item (Megatron's `_extra_state` / common state slot) pickles a call to os.system is
refused naming the file and the item; one whose `.metadata` does is refused naming it; a per-rank optimizer
file (train/checkpoints.py) holding one is refused, while a real one (torch's AdamW state, the layout, a
ZeRO-2 master shard) reads. No refused file runs what it names (a marker file it would create stays absent).
Through a resume (the newest step refused, the run falling back with one line): tests/dist/test_checkpoint_atomic.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from longstraw_mcore.checkpoint.common import CheckpointError
from longstraw_mcore.checkpoint.no_pickle import check_dcp, load_torch_file


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_only_data_is_read(tmp_path):
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "common": {"step": 3, "x": [1.0, None], "t": (1, "a")}},
             checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    check_dcp(tmp_path / "plain")

    dcp.save({"w": torch.ones(3), "evil": _RunsCode(marker)}, checkpoint_id=str(tmp_path / "item"), no_dist=True)
    with pytest.raises(CheckpointError) as e:
        check_dcp(tmp_path / "item")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'item'}/__0_0.distcp: refusing to read it (item 'evil'")
    assert "posix.system" in msg, msg

    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: refusing to read it \(it asks for posix\.system\)"):
        check_dcp(tmp_path / "meta")

    torch.save({"torch_optimizers": [_RunsCode(marker)]}, tmp_path / "optimizer_rank00000.pt")
    with pytest.raises(CheckpointError, match=r"optimizer_rank00000\.pt: refusing to read it \(unsupported GLOBAL"):
        load_torch_file(tmp_path / "optimizer_rank00000.pt")
    assert not marker.exists()


def test_a_real_per_rank_optimizer_file_reads(tmp_path):
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    p.grad = torch.randn(4, 3)
    opt.step()
    blob = {"torch_optimizers": [opt.state_dict()], "layout": {"tp": 1, "pp": 2, "cp": 1, "dp": 1, "world_size": 2},
            "rank": 1, "extra": {"main_shards": [torch.randn(5)]}}
    torch.save(blob, tmp_path / "optimizer_rank00001.pt")
    got = load_torch_file(tmp_path / "optimizer_rank00001.pt")
    assert got["layout"] == blob["layout"]
    assert torch.equal(got["extra"]["main_shards"][0], blob["extra"]["main_shards"][0])
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, 3))], lr=1e-3)
    fresh.load_state_dict(got["torch_optimizers"][0])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_the_readers_themselves_read_only_data(tmp_path):
    """After install() (check_dcp calls it), torch's own reader and planner refuse what check_dcp refuses: a
    file swapped in between the check and the load runs nothing either; the refusal comes out of torch's
    collective reader as one line (one_line_errors, around every Megatron load here)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from longstraw_mcore.checkpoint.no_pickle import install, one_line_errors

    install()
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "evil": _RunsCode(marker)}, checkpoint_id=str(tmp_path / "item"), no_dist=True)
    with pytest.raises(CheckpointError) as e, one_line_errors(tmp_path / "item"):
        dcp.load({"w": torch.empty(3), "evil": None}, checkpoint_id=str(tmp_path / "item"), no_dist=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'item'}: item 'evil': refusing to read it (unsupported "
                                              "GLOBAL posix.system"), msg
    (tmp_path / "item" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"refusing to read it \(it asks for posix\.system\)"):
        FileSystemReader(str(tmp_path / "item")).read_metadata()
    assert not marker.exists()
    got = {"w": torch.empty(3), "step": None, "note": None}
    dcp.save({"w": torch.arange(3.0), "step": 3, "note": ("a", [1.5, None])}, checkpoint_id=str(tmp_path / "plain"),
             no_dist=True)
    dcp.load(got, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    assert got["step"] == 3 and got["note"] == ("a", [1.5, None]) and torch.equal(got["w"], torch.arange(3.0))
