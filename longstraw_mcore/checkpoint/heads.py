"""A critic's and a reward model's Hugging Face form: the family's decoder plus `score` in place of `lm_head`.

    head            architectures (config.json)                              tensors beside the decoder
    lm              the family's ARCHITECTURES (Qwen3_5ForCausalLM, ...)      lm_head.weight [V, H]
    token_value     <Family>ForTokenClassification, num_labels 1             score.weight [1, H], score.bias [1]
    sequence_score  <Family>ForSequenceClassification (and Qwen's Text...)   score.weight [1, H]

transformers' own classes for Qwen3.5/3.6 (Qwen3_5ForTokenClassification: the token-classification
layout, `score` on the final norm's output with a bias; Qwen3_5ForSequenceClassification: no bias, the
last token's score); GLM-5.x has none in transformers, so the same layout goes under GLM's names
(GlmMoeDsaForTokenClassification, GlmMoeDsaForSequenceClassification). A family lists its names in
`HEADS` (checkpoint/<family>.py); `mapping(family.checkpoint, head)` is the family's table with the head
swapped, used by the converter in both directions (checkpoint/convert.py).
"""

from __future__ import annotations

from longstraw_mcore.checkpoint import rule_table
from longstraw_mcore.checkpoint.common import CheckpointError
from longstraw_mcore.checkpoint.rule_table import Rule

LM_HEAD = "lm_head.weight"


def head_of_model(model) -> str:
    """A built model's output head (models/heads.py), through any wrapper (DDP, Float16Module)."""
    while not hasattr(model, "head") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "head", "lm")


def head_of(raw: dict, base) -> str:
    """The head a config.json's architectures name (`base`: the family's checkpoint module)."""
    archs = raw.get("architectures") or []
    for head, names in base.HEADS.items():
        if any(a in names for a in archs):
            return head
    return "lm"


def architectures(base) -> tuple[str, ...]:
    """Every architecture the family reads: its language models' and its heads'."""
    return tuple(base.ARCHITECTURES) + tuple(a for names in base.HEADS.values() for a in names)


def config_dict(base, m, head: str) -> dict:
    """The config.json of `m` with `head` (the family's own for lm)."""
    d = base.hf_config_dict(m)
    if head != "lm":
        d["architectures"] = [base.HEADS[head][0]]
        d["id2label"], d["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return d


def check_head(raw: dict, base, want: str, src) -> None:
    got = head_of(raw, base)
    if got != want:
        roles = {"lm": "a policy (--hf, --ref-hf)", "token_value": "a critic (--critic)",
                 "sequence_score": "a reward model (--reward-model)"}
        raise CheckpointError(f"{src}: architecture {raw.get('architectures')} is {roles[got]}, but it was given "
                              f"as {roles[want]}")


class HeadMapping:
    """The family's checkpoint module with its output tensor swapped for `head`'s (any attribute not
    overridden here is the family's)."""

    def __init__(self, base, head: str):
        self.base, self.head = base, head

    def __getattr__(self, name):
        return getattr(self.base, name)

    def rules(self, m) -> list[Rule]:
        out = [r for r in self.base.rules(m) if r.hf != (LM_HEAD,)]
        out.append(Rule(("score.weight",), ("output_layer.weight",), "identity"))
        if self.head == "token_value":
            out.append(Rule(("score.bias",), ("output_layer.bias",), "identity"))
        return out

    def hf_shapes(self, m) -> dict:
        shapes = {k: v for k, v in self.base.hf_shapes(m).items() if k != LM_HEAD}
        shapes["score.weight"] = (1, m.hidden_size)
        if self.head == "token_value":
            shapes["score.bias"] = (1,)
        return shapes

    def LazyCanonical(self, hf, m, where: str = "checkpoint"):
        return rule_table.LazyCanonical(hf, self.rules(m), self.hf_shapes(m), where)

    def mcore_to_hf(self, mc: dict, m, only: Rule | None = None) -> dict:
        return rule_table.to_hf(mc, [only] if only is not None else self.rules(m))

    def hf_to_mcore(self, hf, m, where: str = "checkpoint") -> dict:
        lazy = self.LazyCanonical(hf, m, where)
        return {k: lazy[k] for k in lazy}

    def hf_config_dict(self, m) -> dict:
        return config_dict(self.base, m, self.head)


def mapping(base, head: str):
    """The checkpoint table of a model with `head` (the family's module itself for lm)."""
    return base if head == "lm" else HeadMapping(base, head)
