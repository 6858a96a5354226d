"""PPO with a critic, computed the plain way for the tests: transformers' models (Qwen3_5ForCausalLM as the
policy, Qwen3_5ForTokenClassification with one label as the critic, Qwen3_5TextForSequenceClassification
as a reward model), full sequences with autograd (exact) or a no-grad prompt cache (detached), and PPO's
losses written out per sequence here, independently of longstraw_mcore/loss/ppo.py: GAE as the explicit
sum A_k = sum_l (gamma lam)^l delta_{k+l} over the trained tokens, not a recursion."""

from __future__ import annotations

import copy
import json
import random

import torch

from hf_reference import LiftFloat32ToFloat64, build_hf_model


def build_scalar_model(m, kind: str, seed: int):
    """A transformers critic ("token") or reward model ("sequence") of config `m`, weights moved off HF's
    constant initialisations as build_hf_model does."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5ForTokenClassification,
                                                              Qwen3_5TextForSequenceClassification)

    from longstraw_mcore.checkpoint.qwen3_5 import hf_config_dict

    raw = hf_config_dict(m)
    for k in ("architectures", "model_type", "dtype"):
        raw.pop(k)
    cfg = Qwen3_5TextConfig(**raw, num_labels=1)
    cfg._attn_implementation = "eager"
    cls = Qwen3_5ForTokenClassification if kind == "token" else Qwen3_5TextForSequenceClassification
    torch.manual_seed(seed)
    with LiftFloat32ToFloat64():
        model = cls(cfg).to(m.torch_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.1 if p.dim() == 1 else 0.01) * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            if name.endswith("A_log"):
                p.copy_((0.05 + 0.95 * torch.rand(p.shape, generator=gen, dtype=torch.float64)).log())
            if name == "score.weight":
                p.mul_(20.0)  # values of order 1: the clipped value loss then has something to clip
    model.eval()
    return model


def write_models_and_rollouts(d, m, seed: int = 0, tree: bool = False):
    """policy/, critic/, rm/ and r.jsonl under `d`: two groups with reference log-probs (the KL reward);
    group 1 with a loss mask, old log-probs and old values (group 0's old log-probs are the policy's own,
    scored first); with `tree`, group 0's responses share a prefix.
    Returns the three transformers models."""
    with LiftFloat32ToFloat64():
        policy = build_hf_model(m, seed=seed + 3)
    critic, rm = build_scalar_model(m, "token", seed + 5), build_scalar_model(m, "sequence", seed + 7)
    for model, name in ((policy, "policy"), (critic, "critic"), (rm, "rm")):
        model.save_pretrained(d / name)
    write_groups(d / "r.jsonl", m.vocab_size, 24, (3, 8), seed, tree=tree, kl=True)
    return policy, critic, rm


def write_groups(path, V: int, prompt_len: int, lengths: tuple[int, int], seed: int, tree: bool = False,
                 kl: bool = True) -> None:
    """Two groups of 3 responses (lengths in [lengths)), random rewards; with `kl` reference log-probs (the
    KL reward); group 1 with a loss mask, old log-probs and old values (group 0's old log-probs are the
    policy's own, scored first); with `tree`, group 0's responses share a 3-token prefix."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for gi in range(2):
            prompt = [rng.randrange(V) for _ in range(prompt_len)]
            resps = [[rng.randrange(V) for _ in range(rng.randrange(*lengths))] for _ in range(3)]
            if tree and gi == 0:
                stem = [rng.randrange(V) for _ in range(3)]
                resps = [stem + r for r in resps]
            obj = {"prompt": prompt, "responses": resps, "rewards": [rng.uniform(-1, 2) for _ in resps]}
            if kl:
                obj["ref_logprobs"] = [[-rng.uniform(3, 6) for _ in r] for r in resps]
            if gi == 1:
                obj["loss_masks"] = [[1] * len(r) for r in resps]
                obj["loss_masks"][0][1] = 0
                obj["loss_masks"][2][-1] = 0
                obj["old_values"] = [[rng.uniform(-1, 1) for _ in r] for r in resps]
                obj["old_logprobs"] = [[-rng.uniform(3, 6) for _ in r] for r in resps]
            f.write(json.dumps(obj) + "\n")


def plain_advantages(outcome, values, mask, gamma, lam, beta=0.0, old=None, ref=None):
    """(advantages, returns) of one branch, per token (0 where masked)."""
    n = len(values)
    idx = [t for t in range(n) if mask is None or mask[t]]
    r = [(-beta * (old[t] - ref[t]) if beta > 0 else 0.0) for t in idx]
    r[-1] += outcome
    v = [values[t] for t in idx] + [0.0]
    delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(idx))]
    adv, ret = [0.0] * n, [0.0] * n
    for k, t in enumerate(idx):
        adv[t] = sum((gamma * lam) ** j * delta[k + j] for j in range(len(idx) - k))
        ret[t] = adv[t] + values[t]
    return adv, ret


def branch_outputs(policy, critic, prompt, resp, mode, caches=None):
    """(log-probs [R], values [R]) of one response, with autograd: the whole sequence (exact), or the
    response against copies of the no-grad prompt caches (detached)."""
    from longstraw_mcore.bench.vs_transformers import assigning_linear_cache

    critic = critic.get_base_model() if hasattr(critic, "get_base_model") else critic  # (a PEFT critic: in place)
    if mode == "exact":
        ids = torch.tensor([prompt + resp])
        logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1]
        hidden = critic.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:-1]
    else:
        ids = torch.tensor([[prompt[-1]] + resp[:-1]])
        pc, cc = (copy.deepcopy(c) for c in caches)
        with assigning_linear_cache():
            logits = policy(input_ids=ids, past_key_values=pc, use_cache=True).logits[0]
            hidden = critic.model(input_ids=ids, past_key_values=cc, use_cache=True).last_hidden_state[0]
    logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
    return logp, critic.score(hidden)[:, 0].double()


def prompt_caches(policy, critic, prompt):
    from transformers import DynamicCache

    with torch.no_grad():
        pc, cc = DynamicCache(config=policy.config), DynamicCache(config=critic.config)
        policy(input_ids=torch.tensor([prompt[:-1]]), past_key_values=pc, use_cache=True)
        critic.model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cc, use_cache=True)
    return pc, cc


def reference(policy, critic, groups, mode, gamma, lam, vf_coef, clip, eps=0.2, beta=0.0):
    """Validate's numbers, the plain way: per group the token-mean PPO losses, the groups averaged."""
    out = {"loss": 0.0, "value_loss": 0.0, "values": [], "advantages": [], "returns": [], "logprobs": []}
    n = len(groups)
    for g in groups:
        masks = g.loss_masks or [None] * len(g.responses)
        total = sum(len(r) if mk is None else sum(mk) for r, mk in zip(g.responses, masks))
        with LiftFloat32ToFloat64():
            caches = prompt_caches(policy, critic, g.prompt) if mode == "detached" else None
            rows = [branch_outputs(policy, critic, g.prompt, r, mode, caches) for r in g.responses]
        lpi = lv = 0.0
        vals, advs, rets = [], [], []
        for b, (logp, val) in enumerate(rows):
            mk = masks[b]
            keep = torch.tensor([1.0 if mk is None or mk[t] else 0.0 for t in range(len(val))], dtype=torch.float64)
            base = g.old_values[b] if g.old_values is not None else val.detach().tolist()
            old = g.old_logprobs[b] if g.old_logprobs is not None else logp.detach().tolist()
            ref = g.ref_logprobs[b] if g.ref_logprobs is not None else None
            adv, ret = plain_advantages(g.rewards[b], base, mk, gamma, lam, beta, old, ref)
            a, R, B = (torch.tensor(x, dtype=torch.float64) for x in (adv, ret, base))
            ratio = torch.exp(logp - torch.tensor(old, dtype=torch.float64))
            surr = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
            lpi = lpi + (surr * keep).sum() / total
            vclip = B + (val - B).clamp(-clip, clip)
            v = 0.5 * torch.maximum((val - R) ** 2, (vclip - R) ** 2) if clip > 0 else 0.5 * (val - R) ** 2
            lv = lv + vf_coef * (v * keep).sum() / total
            vals.append(val.detach().tolist())
            advs.append(adv)
            rets.append(ret)
        (lpi / n + lv / n).backward()
        out["loss"] += float(lpi) / n
        out["value_loss"] += float(lv) / n
        for k, x in (("values", vals), ("advantages", advs), ("returns", rets),
                     ("logprobs", [lp.detach().tolist() for lp, _ in rows])):
            out[k].append(x)
    return out


def reward_scores(rm, groups):
    """The sequence-classification model's score of every response, from full sequences."""
    with LiftFloat32ToFloat64(), torch.no_grad():
        return [[float(rm(input_ids=torch.tensor([g.prompt + r])).logits[0, 0]) for r in g.responses] for g in groups]


def grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def peft_critic(critic, path, targets: list[str], r: int, alpha: float, seed: int):
    """`peft` LoRA on a copy of the transformers critic as PEFT's token-classification task builds it (its
    `score` kept whole: modules_to_save), A and B random (B at 0.1 of PEFT's non-zero init) and the kept
    score moved off the base's (so a run that ignored it would differ), saved to `path` by PEFT itself."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(critic), LoraConfig(task_type="TOKEN_CLS", r=r, lora_alpha=alpha,
                                                             target_modules=targets, lora_dropout=0.0,
                                                             init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(torch.float64) * (0.1 if "lora_B" in n else 1.0)
            elif "modules_to_save" in n:
                p.mul_(-0.7).add_(0.05)
    model.eval()
    model.save_pretrained(str(path))
    return model


def peft_grads(model) -> dict:
    """A PEFT model's trainable gradients under the names PEFT saves them by (and `validate` dumps them by)."""
    return {k.replace(".default", "").replace("modules_to_save.", ""): p.grad.detach().clone()
            for k, p in model.named_parameters() if p.requires_grad and p.grad is not None}


class GlmCritic(torch.nn.Module):
    """transformers' GlmMoeDsaModel with `score` = Linear(hidden, 1) on its final norm's output: the
    token-classification layout with one label under GLM's names (transformers has no such class)."""

    base_model_prefix = "model"  # (what PEFT asks of a model it wraps)

    def __init__(self, cfg, seed: int):
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M

        super().__init__()
        torch.manual_seed(seed)
        self.config = cfg
        self.model = M.GlmMoeDsaModel(cfg).to(torch.float64)
        self.score = torch.nn.Linear(cfg.hidden_size, 1, dtype=torch.float64)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if p.dim() == 1 and not n.startswith("score"):
                    p.add_(0.1 * torch.randn_like(p))
                elif "experts" in n:
                    p.normal_(0, 0.2)
            self.score.weight.mul_(20.0)

    def save(self, d) -> None:
        """Through transformers' own writer (its stored names: experts one by one), with `lm_head` swapped
        for `score`."""
        from safetensors.torch import load_file, save_file
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M

        shell = M.GlmMoeDsaForCausalLM(self.config).to(torch.float64)
        shell.model.load_state_dict(self.model.state_dict())
        shell.save_pretrained(d)
        tensors = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if k != "lm_head.weight"}
        tensors.update({f"score.{k}": v.detach().clone() for k, v in self.score.named_parameters()})
        save_file(tensors, str(d / "model.safetensors"))
        raw = json.loads((d / "config.json").read_text())
        raw["architectures"] = ["GlmMoeDsaForTokenClassification"]
        raw["id2label"], raw["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
        (d / "config.json").write_text(json.dumps(raw))


def write_glm(d, hf_cfg, seed: int = 0):
    """A GLM policy (GlmMoeDsaForCausalLM) and critic (GlmCritic) under `d`, and r.jsonl (two groups, one with
    a loss mask and old values); returns (policy, critic)."""
    from test_glm_parity import _hf_model  # (tests/reference: the GLM parity test's weights)

    with LiftFloat32ToFloat64():
        policy = _hf_model(hf_cfg, seed)
        critic = GlmCritic(hf_cfg, seed + 1)
    policy.eval()
    critic.eval()
    policy.save_pretrained(d / "policy")
    critic.save(d / "critic")
    write_groups(d / "r.jsonl", hf_cfg.vocab_size, 13, (2, 6), seed, kl=False)
    return policy, critic
