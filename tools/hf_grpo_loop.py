#!/usr/bin/env python
"""GRPO in a dozen lines of plain PyTorch on transformers' own Qwen3.6-family model: an independent
reference for the learning dynamics of `train --online` on the coding example (nothing of this project's
model, replay or trainer runs here; only its config-to-HF-config mapping and the example's row generator).

  PYTHONPATH=. python tools/hf_grpo_loop.py --tokenizer DIR [--lr 1e-3] [--steps 200] [--shaping 0.2]
      [--modules 1] [--funcs 3] [--prompts 32] [--group 16] [--seed 0] [--out FILE.json]

The model: configs/demo-coding.yaml's tiny hybrid (vocabulary = the tokenizer's), random init, float32,
Adam. A step draws `--prompts` rows of examples/coding (`--modules` modules of 1..`--funcs` functions),
samples `--group` one-token answers per prompt at temperature 1 from the last position's logits, scores
them (1 for the right digit, `--shaping` for any digit: the demo's two rewards, weights 1 and 0.2) and
takes one step on -(A log p(answer)) with A the group's reward minus its mean over its std (groups with
equal rewards: 0), as GRPO does on-policy with one answer token. Prints the sampled accuracy every 5 steps
and writes them to --out (JSON). 200 steps take about 4 minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "coding"))


def build_model(vocab: int):
    import torch
    from transformers import Qwen3_5TextConfig

    from longstraw_mcore.bench.hf_kernels import qwen3_5_modeling
    from longstraw_mcore.checkpoint.qwen3_5 import hf_config_dict
    from longstraw_mcore.config import load_config

    m = load_config(os.path.join(ROOT, "configs", "demo-coding.yaml"), [f"model.vocab_size={vocab}"]).model
    raw = hf_config_dict(m)
    for k in ("architectures", "model_type", "dtype"):
        raw.pop(k)
    cfg = Qwen3_5TextConfig(**raw)
    cfg._attn_implementation = "eager"
    return qwen3_5_modeling(fla=False).Qwen3_5ForCausalLM(cfg).to(torch.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--shaping", type=float, default=0.2)
    p.add_argument("--modules", type=int, default=1)
    p.add_argument("--funcs", type=int, default=3)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    import make_dataset

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    model = build_model(len(tok))
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    rng = random.Random(a.seed)
    rows = [make_dataset.make_row(rng, a.modules, a.funcs) for _ in range(4000)]
    data = [(tok(r["prompt"])["input_ids"], tok(r["answer"])["input_ids"][0]) for r in rows]
    digits = torch.tensor(sorted({y for _, y in data}))
    curve = []
    for step in range(1, a.steps + 1):
        batch = [rng.choice(data) for _ in range(a.prompts)]
        n = max(len(x) for x, _ in batch)
        ids = torch.tensor([[0] * (n - len(x)) + x for x, _ in batch])          # left-padded, pad masked
        mask = torch.tensor([[0] * (n - len(x)) + [1] * len(x) for x, _ in batch])
        y = torch.tensor([t for _, t in batch])
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, -1].float(), -1)
        with torch.no_grad():
            ans = torch.multinomial(logp.exp(), a.group, replacement=True)      # [prompts, G]
            r = (ans == y[:, None]).float() + a.shaping * torch.isin(ans, digits).float()
            std = r.std(1, keepdim=True)
            adv = torch.where(std > 0, (r - r.mean(1, keepdim=True)) / (std + 1e-6), torch.zeros_like(r))
        loss = -(adv * torch.gather(logp, 1, ans)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0:
            correct = float((ans == y[:, None]).float().mean())
            curve.append({"step": step, "correct": correct, "digit": float(torch.isin(ans, digits).float().mean())})
            print(f"step {step}: sampled correct {correct:.3f}, a digit {curve[-1]['digit']:.3f}", flush=True)
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump({"args": vars(a), "chance": 1 / len(digits), "curve": curve}, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
