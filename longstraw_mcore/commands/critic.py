"""The second models of a run: a critic (`--critic DIR`, `grpo.objective=ppo`) and a reward model
(`--reward-model DIR`). Each is a Hugging Face directory in its head's layout (checkpoint/heads.py), run in
the policy's layout, dtype and replay settings. `critic_config` / `reward_config` read only config.json
and refuse a bad pairing before any model work (exit 2, one line); `build_second` builds and loads one.
`--critic policy` starts the critic from the policy's own starting weights with a new value head
(weight ~ N(0, 0.02), bias 0), for runs whose policy has no trained critic beside it (the demos); a
Megatron checkpoint of a critic (a PPO run's --save DIR/critic/step_N) loads at any layout. The critic
may train adapters (`critic_adapter.rank > 0`: LoRA / QLoRA, its value head trained whole as PEFT's
token-classification task keeps it), new or from a PEFT directory (`--critic-adapter DIR`).
"""

from __future__ import annotations

import dataclasses

from longstraw_mcore.config import ConfigError

FROM_POLICY = "policy"


def megatron_dir(path: str) -> bool:
    """A longstraw Megatron checkpoint (a step directory, e.g. a PPO run's --save DIR/critic/step_N). Imports
    nothing of Megatron's: it is asked while the input is checked."""
    from pathlib import Path

    from longstraw_mcore.checkpoint.common import CONFIG_FILE

    return (Path(path) / CONFIG_FILE).is_file()


def _second_config(cfg, path: str, head: str, flag: str):
    if megatron_dir(path):
        from pathlib import Path

        from longstraw_mcore.checkpoint.dist_ckpt import read_checkpoint_meta
        from longstraw_mcore.train.checkpoints import ADAPTER_DIR

        m, meta = read_checkpoint_meta(path)
        if (Path(path) / ADAPTER_DIR).is_dir():
            raise ConfigError(f"{flag} {path}: a checkpoint of adapters alone; give their base as {flag} and the "
                              f"adapters as {flag}-adapter {Path(path) / ADAPTER_DIR}")
        if meta.get("head", "lm") != head:
            raise ConfigError(f"{flag} {path}: a Megatron checkpoint with a {meta.get('head', 'lm')!r} head; "
                              f"{flag} needs a {head!r} one (a PPO run's --save DIR/critic/step_N)")
    else:
        from longstraw_mcore.checkpoint import heads
        from longstraw_mcore.families import family_of_dir

        fam = family_of_dir(path)
        m, raw = fam.checkpoint.read_config(path)
        heads.check_head(raw, fam.checkpoint, head, path)
    if m.vocab_size < cfg.model.vocab_size:
        raise ConfigError(f"{flag} {path}: its vocabulary of {m.vocab_size} does not hold the policy's tokens "
                          f"(ids up to {cfg.model.vocab_size - 1}); it must read the same token ids")
    run = {k: getattr(cfg.model, k) for k in m.RUN_SETTINGS if hasattr(m, k) and hasattr(cfg.model, k)}
    m = dataclasses.replace(m, **run)
    try:
        m.check_layout(cfg.parallel)
    except ConfigError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None
    from longstraw_mcore.config import AdapterConfig

    adapter = cfg.critic_adapter.as_adapter() if head == "token_value" else AdapterConfig()
    return dataclasses.replace(cfg, model=m, adapter=adapter)


def critic_config(cfg, path: str | None, adapter_path: str | None = None):
    """The critic's run config (None without --critic), checked against the objective and the policy. Its
    `adapter` section is the run's `critic_adapter` (LoRA / QLoRA on the critic, its value head trained whole),
    or `adapter_path`'s (`--critic-adapter`: a PEFT directory of a critic, checked here against the model)."""
    if adapter_path is not None and path is None:
        raise ConfigError(f"--critic-adapter {adapter_path}: needs --critic (the base the adapter sits on)")
    if cfg.critic_adapter.enabled and cfg.grpo.objective != "ppo":
        raise ConfigError(f"critic_adapter.rank={cfg.critic_adapter.rank}: adapters on a critic, which only "
                          f"grpo.objective=ppo uses (the objective is {cfg.grpo.objective})")
    ccfg = _critic_config(cfg, path)
    if ccfg is None or adapter_path is None:
        return ccfg
    adapter, _, _ = read_critic_adapter(ccfg, adapter_path, load=False)  # (checked from the file's header)
    adapter.check_against(ccfg.model.projection_shapes(), ccfg.model.family)
    return dataclasses.replace(ccfg, adapter=adapter)


def read_critic_adapter(ccfg, path: str, load: bool = True):
    """A critic's PEFT directory against the critic of `ccfg`: (its adapter section, {module: (A, B)}, its
    value head's whole tensors); `load` False: the checks alone, from the file's header (peft_io.read_peft)."""
    from longstraw_mcore.adapters.peft_io import CRITIC_SAVED_NAMES, read_peft, read_saved, saved_shapes
    from longstraw_mcore.families import get_family

    sites = get_family(ccfg.model.family).checkpoint.adapter_sites(ccfg.model)
    adapter, canonical = read_peft(path, sites, ccfg.adapter, saved=CRITIC_SAVED_NAMES, load=load)
    return adapter, canonical, read_saved(path, saved_shapes(ccfg.model), load=load)


def _critic_config(cfg, path: str | None):
    if cfg.grpo.objective == "ppo" and path is None:
        raise ConfigError("grpo.objective=ppo needs a critic: --critic DIR (a token-classification model with one "
                          "label, e.g. Qwen3_5ForTokenClassification; the policy's weights with a new head will do)")
    if path is None:
        return None
    if cfg.grpo.objective != "ppo":
        raise ConfigError(f"--critic {path}: a critic is used only by grpo.objective=ppo (the objective is "
                          f"{cfg.grpo.objective})")
    if path == FROM_POLICY:
        return dataclasses.replace(cfg, adapter=cfg.critic_adapter.as_adapter())
    return _second_config(cfg, path, "token_value", "--critic")


def reward_config(cfg, path: str | None, cmd: str = "validate"):
    """The reward model's run config (None without --reward-model)."""
    if path is None:
        return None
    if cmd == "train" and cfg.parallel.ep > 1:
        raise ConfigError(f"--reward-model {path} with parallel.ep={cfg.parallel.ep} in `train`: the data-parallel "
                          "ranks score different groups, and an MoE reward model's all-to-alls need them in lockstep; "
                          "score the rollouts first (`validate --reward-model` writes reward_model_scores) or train "
                          "with parallel.ep=1")
    if cfg.parallel.vpp > 1:
        raise ConfigError(f"--reward-model {path} with parallel.vpp={cfg.parallel.vpp}: a reward model is built as one "
                          "model chunk per pipeline rank; score the rollouts first (`validate --reward-model`, at "
                          "parallel.vpp=1) or train with parallel.vpp=1")
    if cfg.grpo.objective == "dpo":
        raise ConfigError(f"--reward-model {path}: DPO reads preferences from the rollouts' rewards; a reward "
                          "model scores responses for grpo or ppo")
    return _second_config(cfg, path, "sequence_score", "--reward-model")


def build_second(cfg2, par, path: str, what: str, trainable: bool, policy=None, adapter_path: str | None = None):
    """This rank's part of the critic / reward model, loaded from `path` (or, for `--critic policy`, from
    `policy`'s weights: every tensor but the output layer, at the same layout). A trainable model whose
    config has adapters (the critic's `critic_adapter`) gets them: its base frozen (quantized under
    base_dtype nf4 / fp8), its value head trained whole; new (B = 0) or `adapter_path`'s (--critic-adapter,
    its value head included where the directory holds one)."""
    from longstraw_mcore.checkpoint.convert import load_hf_into_model
    from longstraw_mcore.commands.common import rank0_print
    from longstraw_mcore.families import get_family

    head = "token_value" if what == "critic" else "sequence_score"
    family = get_family(cfg2.model.family)
    model = family.build_model(cfg2.model, par, cfg2.resolved_device(), head=head)
    if path == FROM_POLICY:
        _copy_trunk(policy, model)
        rank0_print(f"[{what}] the policy's weights with a new value head ({cfg2.model.describe()})")
    elif megatron_dir(path):
        from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint

        load_checkpoint(model, path)
        rank0_print(f"[{what}] loaded Megatron checkpoint {path} ({head} head, {cfg2.model.describe()})")
    else:
        load_hf_into_model(family, model, path, expect=None)
        rank0_print(f"[{what}] loaded {path} ({cfg2.model.family}, {head} head, {cfg2.model.describe()})")
    if not trainable:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    elif cfg2.adapter.enabled:
        _attach_critic_adapters(cfg2, par, model, what, adapter_path)
    return model


def _attach_critic_adapters(cfg2, par, model, what: str, adapter_path: str | None) -> None:
    from longstraw_mcore.adapters.attach import attach
    from longstraw_mcore.commands.common import rank0_print
    from longstraw_mcore.families import get_family

    sites = get_family(cfg2.model.family).checkpoint.adapter_sites(cfg2.model)
    canonical = whole = None
    if adapter_path is not None:
        _, canonical, whole = read_critic_adapter(cfg2, adapter_path)
    # seed + 1: the critic's new A factors are not the policy's
    aset = attach(model, sites, cfg2.adapter, par, cfg2.seed + 1, canonical, None, whole)
    a = cfg2.adapter
    rank0_print(f"[{what}] LoRA r={a.rank} alpha={a.alpha:g} base {a.base_dtype} on "
                f"{', '.join(a.resolved_targets(cfg2.model.projection_shapes()))} "
                f"({'read from ' + adapter_path if adapter_path else 'new: B = 0'}); the value head trains whole; "
                f"rank 0 holds {aset.num_params():,} trainable parameters")


def _copy_trunk(policy, critic) -> None:
    """Every parameter of the policy's but its output layer into the critic (same config and layout)."""
    import torch

    while hasattr(policy, "module"):
        policy = policy.module
    theirs = dict(policy.named_parameters())
    with torch.no_grad():
        for name, p in critic.named_parameters():
            if name.startswith("output_layer."):
                continue
            if name not in theirs or theirs[name].shape != p.shape:
                raise ConfigError(f"--critic policy: the policy's {name} is not a plain weight of the critic's shape "
                                  "(a quantized QLoRA base?); give the critic as a Hugging Face directory")
            p.copy_(theirs[name])
