"""Every config in configs/ passes `longstraw check` for the main job at its own layout, and every
example command written in a launch/ script passes it for the subcommand that script runs, at the
world size the example asks for (nodes x GPUs per node). A layout a real model cannot take fails
here, not on a cluster."""

from __future__ import annotations

import re
from pathlib import Path

from longstraw_mcore.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_passes_the_checker(capsys):
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for cfg in configs:
        from longstraw_mcore.config import load_config

        p = load_config(cfg).parallel
        assert main(["check", "--config", str(cfg), "--world-size", str(p.tp * p.pp * p.cp)]) == 0, cfg
        assert "[check] ok" in capsys.readouterr().out


def test_every_launch_example_passes_the_checker(capsys):
    scripts = sorted((ROOT / "launch").glob("*"))
    examples = 0
    for script in scripts:
        text = script.read_text()
        cmd = [c for c in re.findall(r"-m longstraw_mcore (\w+) ", text) if c != "check"][-1]  # what it launches
        for line in re.findall(r"#\s*example:\s*(sbatch .*)", text):
            nodes = int(re.search(r"--nodes (\d+)", line).group(1))
            gpus = int(re.search(r"--gpus-per-node (\d+)", line).group(1))
            after = line.split(script.name, 1)[1].split()
            cfg, overrides = after[0], after[1:]
            rc = main(["check", "--cmd", cmd, "--config", str(ROOT / cfg), "--world-size", str(nodes * gpus),
                       "device=cuda", *overrides])
            assert rc == 0, (script.name, line, capsys.readouterr().err)
            examples += 1
    assert examples >= 2
