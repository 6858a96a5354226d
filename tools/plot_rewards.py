#!/usr/bin/env python
"""Held-out reward (and the sampled groups' mean reward) against step, from one or more metrics.jsonl
files of `longstraw train --online`, as a PNG (matplotlib, Agg backend).

  python tools/plot_rewards.py runs/demo/metrics.jsonl --out runs/demo/reward.png [--chance 0.0625]
      [--label detached] [more.jsonl --label exact ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def read(path: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    held, sampled = [], []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            m = json.loads(line)
            if "heldout_reward" in m:
                held.append((m["step"], m["heldout_reward"]))
            if "reward_mean" in m:
                sampled.append((m["step"], m["reward_mean"]))
    return held, sampled


def plot(runs: list[tuple[str, str]], out: str, chance: float | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, (path, label) in enumerate(runs):
        held, sampled = read(path)
        if not held:
            raise SystemExit(f"error: {path} has no heldout_reward lines (train --online with task.eval_prompts > 0)")
        color = plt.get_cmap("tab10").colors[n % 10]
        ax.plot(*zip(*held), marker="o", color=color, label=f"{label} held-out (greedy)")
        if sampled and len(runs) == 1:
            ax.plot(*zip(*sampled), color=color, alpha=0.3, linewidth=1, label=f"{label} sampled groups")
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle="--", linewidth=1, label=f"chance (prompt ignored) {chance:.3f}")
        ax.axhline(5 * chance, color="gray", linestyle=":", linewidth=1, label=f"5x chance {5 * chance:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+")
    p.add_argument("--label", action="append", default=None, help="one per metrics file")
    p.add_argument("--out", required=True)
    p.add_argument("--chance", type=float, default=None)
    p.add_argument("--title", default="key recall: on-policy GRPO with branch replay")
    a = p.parse_intermixed_args(argv)
    labels = a.label or [os.path.basename(os.path.dirname(os.path.abspath(m))) for m in a.metrics]
    if len(labels) != len(a.metrics):
        p.error(f"{len(a.metrics)} metrics files but {len(labels)} --label")
    for m in a.metrics:
        if not os.path.isfile(m):
            p.error(f"{m}: no such file")
    plot(list(zip(a.metrics, labels)), a.out, a.chance, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
