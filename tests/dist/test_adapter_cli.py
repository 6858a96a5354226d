"""A LoRA round trip as a user runs it (float32, torchrun, TP=2): a PEFT adapter in (`train --adapter`),
2 training steps, the checkpoint's adapter exported (tools/convert_checkpoint.py adapter-export) and
merged; `peft` loads the export into the transformers model and its log-probs equal the project's
(`validate --adapter`, <= 1e-5), the merged model's equal the adapter applied (<= 1e-5); validate's
--dump-grads writes the adapter gradients under PEFT's names. The
checkpoint holds the adapters only (no model shards) and an optimizer state of adapter size: Adam's
two moments of exactly this rank's adapter shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from launch import longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from adapter_reference import random_peft
    from hf_reference import build_hf_model, tiny_model_config
    from make_rollouts import make_groups

    from longstraw_mcore.data.rollouts import write_rollouts

    tmp = tmp_path_factory.mktemp("adapter")
    m = tiny_model_config(dtype="float32")
    build_hf_model(m, seed=9).save_pretrained(tmp / "hf")
    targets = [t for t in m.projection_shapes() if t != "lm_head"]
    random_peft(build_hf_model(m, seed=9), targets, r=4, alpha=8.0, seed=3).save_pretrained(tmp / "peft_in")
    write_rollouts(tmp / "r.jsonl", make_groups(m.vocab_size, 2, 20, 2, 5, seed=4))
    return tmp, m


def _tool(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def _logprobs(model, groups):
    out = []
    with torch.no_grad():
        for g in groups:
            per = []
            for resp in g.responses:
                logits = model(input_ids=torch.tensor([g.prompt + resp[:-1]])).logits[0, len(g.prompt) - 1:]
                per.append(torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0])
            out.append(per)
    return out


def _local_adapter_numel(m, peft_dir, tp):
    """This TP rank's adapter elements: column sites split B, row sites split A (adapters/lora.py)."""
    from safetensors.torch import load_file

    from longstraw_mcore.checkpoint.qwen3_5 import adapter_sites

    t = load_file(str(peft_dir / "adapter_model.safetensors"))
    n = 0
    for s in adapter_sites(m):
        key = f"base_model.model.{s.name}"
        if key + ".lora_A.weight" not in t:
            continue
        a, b = t[key + ".lora_A.weight"].numel(), t[key + ".lora_B.weight"].numel()
        n += (a + b // tp) if s.kind == "column" else (a // tp + b)
    return n


def test_peft_in_train_export_merge_round_trip(case):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from longstraw_mcore.data.rollouts import load_rollouts

    tmp, m = case
    common = ["--hf", str(tmp / "hf"), "--rollouts", str(tmp / "r.jsonl"), "parallel.tp=2", "device=cpu",
              "replay.chunk_len=7"]
    r = longstraw(2, "train", "--adapter", str(tmp / "peft_in"), "--steps", "2", "--save", str(tmp / "run"), *common,
                  "train.lr=0.01")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LoRA r=4 alpha=8" in r.stdout and "trains LoRA r=4" in r.stdout, r.stdout[-2000:]
    step = tmp / "run" / "step_000002"
    assert (step / "adapter" / "adapter_config.json").is_file() and not list(step.glob("*.distcp"))
    # the optimizer holds Adam's two moments of this rank's adapter shards, nothing of the base
    blob = torch.load(step / "optimizer_rank00000.pt", weights_only=False)
    state = [v for o in blob["torch_optimizers"] for s in o["state"].values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert sum(v.numel() for v in state) == 2 * _local_adapter_numel(m, tmp / "peft_in", 2)
    opt_bytes = sum(v.numel() * v.element_size() for v in state)

    e = _tool("adapter-export", str(step), str(tmp / "peft_out"), "--base", str(tmp / "hf"))
    assert e.returncode == 0, e.stderr
    e = _tool("adapter-export", str(step), str(tmp / "merged"), "--merge", "--base", str(tmp / "hf"))
    assert e.returncode == 0, e.stderr
    before, after = load_file(str(tmp / "peft_in" / "adapter_model.safetensors")), \
        load_file(str(tmp / "peft_out" / "adapter_model.safetensors"))
    assert set(before) == set(after)
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4, moved  # two steps at lr 0.01 moved the adapter

    v = longstraw(2, "validate", "--adapter", str(tmp / "peft_out"), "--out", str(tmp / "val"), "--dump-grads",
                  *common)
    assert v.returncode == 0, v.stderr[-3000:]
    grads = load_file(str(tmp / "val" / "grads.safetensors"))  # the adapter gradients, under PEFT's names
    assert set(grads) == set(after) and all(grads[k].shape == after[k].shape for k in after)
    assert all(float(grads[k].abs().max()) > 0 for k in grads if "lora_B" in k)
    receipt = json.loads((tmp / "val" / "receipt.json").read_text())
    assert "LoRA r=4" in receipt["trained"]
    groups = load_rollouts(tmp / "r.jsonl", m.vocab_size)
    base = AutoModelForCausalLM.from_pretrained(tmp / "hf", torch_dtype=torch.float32)
    peft_lp = _logprobs(PeftModel.from_pretrained(base, tmp / "peft_out").eval(), groups)
    merged_lp = _logprobs(AutoModelForCausalLM.from_pretrained(tmp / "merged", torch_dtype=torch.float32).eval(),
                          groups)
    ours = max(abs(a - float(b)) for g1, g2 in zip(receipt["logprobs"], peft_lp) for b1, b2 in zip(g1, g2)
               for a, b in zip(b1, b2))
    merge = max(float((a - b).abs().max()) for g1, g2 in zip(merged_lp, peft_lp) for a, b in zip(g1, g2))
    print(f"LoRA round trip (TP=2, float32): validate vs peft log-probs {ours:.1e}, merged vs peft {merge:.1e}; "
          f"adapter moved {moved:.2e} in 2 steps; optimizer state on rank 0: {opt_bytes:,} bytes")
    assert ours <= 1e-5 and merge <= 1e-5
