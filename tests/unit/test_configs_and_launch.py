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
    import math

    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for cfg in configs:
        from longstraw_mcore.config import load_config

        p = load_config(cfg).parallel
        world = p.tp * p.pp * math.lcm(p.cp, p.ep)  # the smallest world the layout takes
        assert main(["check", "--config", str(cfg), "--world-size", str(world)]) == 0, cfg
        assert "[check] ok" in capsys.readouterr().out


def _examples():
    """(script, subcommand, world size, config, overrides) of every example line in launch/."""
    out = []
    for script in sorted((ROOT / "launch").glob("*")):
        text = re.sub(r"\\\n#\s*", " ", script.read_text()).replace('"', " ")  # join continued example lines
        for m in re.finditer(r"sbatch --nodes (\d+) --gpus-per-node (\d+)(?:\s+--[\w-]+ \S+)*\s+launch/slurm\.sbatch\s+(\w+)"
                             r"\s+(.*)", text):
            args = m.group(4).split()
            cfg = args[args.index("--config") + 1]
            out.append((script.name, m.group(3), int(m.group(1)) * int(m.group(2)), cfg, [a for a in args if "=" in a]))
        for m in re.finditer(r"(?:bash|sbatch --nodes \d+ --gpus-per-node \d+) launch/validate_full_path\.sh\s+(\d+)\s+"
                             r"(\S+)\s+\S+\s+(.*)", text):
            out.append((script.name, "validate", int(m.group(1)), m.group(2),
                        [a for a in m.group(3).split() if "=" in a and not a.startswith("-")]))
    return out


def test_every_launch_example_passes_the_checker(capsys):
    examples = _examples()
    assert len(examples) >= 4, examples
    for script, cmd, world, cfg, overrides in examples:
        device = "device=cuda" if world > 4 else "device=cpu"
        rc = main(["check", "--cmd", cmd, "--config", str(ROOT / cfg), "--world-size", str(world), device, *overrides])
        assert rc == 0, (script, cmd, world, cfg, overrides, capsys.readouterr().err)
