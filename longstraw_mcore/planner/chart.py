"""The plan as a picture: one stacked bar of the per-rank memory components against the device's memory
(`longstraw plan --png FILE`). matplotlib's Agg backend: no display needed. The file is written next to
its final name and renamed into place, so a failed run leaves nothing half-written."""

from __future__ import annotations

import os


def plan_chart(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2**30
    i = res["inputs"]
    parts = [(k, v / gib) for k, v in res["per_rank_bytes"].items() if v > 0]
    fig, ax = plt.subplots(figsize=(9, 3.2))
    left = 0.0
    colors = plt.get_cmap("tab10").colors
    for n, (name, v) in enumerate(parts):
        ax.barh([0], [v], height=0.6, left=left, color=colors[n % len(colors)], label=f"{name} {v:,.1f} GiB")
        left += v
    dev = res["device_bytes"] / gib
    ax.axvline(dev, color="black", linestyle="--", linewidth=1.5)
    ax.text(dev, -0.5, f" {i['device']}: {dev:,.0f} GiB ", va="center", ha="left" if left < dev else "right")
    ax.set_ylim(-0.7, 0.5)
    ax.set_yticks([])
    ax.set_xlabel("GiB per rank")
    ax.set_xlim(0, max(left, dev) * 1.05)
    verdict = "fits" if res["fits"] else "does NOT fit"
    lay = i["layout"]
    ax.set_title(f"{i['family']}  P={i['prompt_len']:,} R={i['response_len']} G={i['group_size']} {i['mode']}, "
                 f"tp{lay['tp']} pp{lay['pp']} cp{lay['cp']} ep{lay['ep']} dp{lay['dp']} on {i['gpus']} GPUs\n"
                 f"{left:,.1f} GiB per rank: {verdict} (largest P that fits: {res['max_prompt_len']:,})", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
