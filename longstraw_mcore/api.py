"""The Python API: branch-replay training driven by the user's own loop (how RL frameworks such as slime
and verl use a Megatron backend). `longstraw train` is built on it.

    from longstraw_mcore.api import Session
    from longstraw_mcore.data.rollouts import RolloutGroup

    s = Session.create("configs/qwen3.6-tiny.yaml", hf="my-model/", overrides=["train.lr=1e-5"])
    for step in range(10):
        groups = []
        for i, prompt in enumerate(my_prompts(step)):            # token ids, from any source
            g = s.sample(prompt, index=step * 1000 + i)           # G responses from the captured prompt state
            groups.append(RolloutGroup(prompt=prompt, responses=g.responses, old_logprobs=g.logprobs,
                                       rewards=my_rewards(g.responses)))
        print(s.step(groups))                                     # one optimizer step: the metrics
    s.save("ckpt/")                                               # resume: Session.create(...).resume("ckpt/")
    for name, tensor in s.hf_weights():                           # Hugging Face names, full tensors on rank 0
        engine.load(name, tensor)

Launch it as any script, its loop under `if __name__ == "__main__":` (checkpoint writing starts worker
processes that import the script again): `python driver.py` (one rank) or `torchrun --nproc-per-node N driver.py`; the
config's parallel section splits the ranks. Every rank runs the same loop: a step's groups are this
data-parallel rank's (the ranks of one model replica pass the same ones). Each group's prompt is
captured anew at each step (the CLI's online loop also hands over the states it sampled against when
adapter.prompt=frozen); `step` validates the groups before any model work.
"""

from __future__ import annotations

from pathlib import Path

from longstraw_mcore.config import RunConfig


class Session:
    def __init__(self, cfg: RunConfig, par, model, ddp, opt, trainer):
        self.cfg, self.par, self.model, self.ddp, self.opt, self.trainer = cfg, par, model, ddp, opt, trainer

    @classmethod
    def create(cls, config: str | Path | RunConfig | None = None, overrides=(), *, hf: str | None = None,
               load: str | None = None, adapter: str | None = None, ref_hf: str | None = None,
               log=None) -> "Session":
        """Build from a config (a YAML path or a RunConfig, plus key=value overrides) and weights: a Hugging
        Face directory (`hf`), a Megatron checkpoint (`load`), or neither (random init); `adapter`: a PEFT
        LoRA directory; `ref_hf`: a reference policy for the KL term. Creates the process groups (from
        torchrun's environment, or one rank)."""
        import argparse

        from longstraw_mcore.commands.common import launch_world_size, load_run_config, rank0_print, resolve_adapter
        from longstraw_mcore.commands.preflight import check_run
        from longstraw_mcore.config import load_config

        args = argparse.Namespace(config=None if isinstance(config, RunConfig) else config, overrides=list(overrides),
                                  hf=hf, load=load, adapter=adapter, ref_hf=ref_hf, ref_load=None)
        cfg = load_config(base=_as_dict(config), overrides=list(overrides)) if isinstance(config, RunConfig) \
            else load_run_config(args)
        cfg, whole_adapter = resolve_adapter(args, cfg)
        check_run(cfg, "train", launch_world_size())
        from longstraw_mcore.parallel.groups import setup_parallel

        return cls.build(args, cfg, whole_adapter, setup_parallel(cfg), log=log or rank0_print)

    @classmethod
    def build(cls, args, cfg: RunConfig, whole_adapter, par, groups=(), online=None, stop=None, log=print) -> "Session":
        """From a checked config and its process groups (what `longstraw train` calls after its checks)."""
        from longstraw_mcore.commands.common import build_and_load, reference_model
        from longstraw_mcore.train.trainer import Trainer, build_training

        model = build_and_load(cfg, par, args.hf, args.load, "train", whole_adapter)
        ddp, opt = build_training(model, cfg, par)
        critic, scorer = second_models(args, cfg, par, model)
        trainer = Trainer(cfg, par, ddp, opt, list(groups), ref_model=reference_model(args, cfg, par), log=log,
                          online=online, stop=stop, critic=critic, reward_model=scorer)
        trainer.passthrough = _passthrough(args, cfg)
        return cls(cfg, par, model, ddp, opt, trainer)

    # --- the loop ----------------------------------------------------------------------------------

    def sample(self, prompt: list[int], index: int = 0, state=None, **rollout):
        """G responses to `prompt` (token ids) sampled from the current weights against its captured state
        (rollout/sampler.sample_group): `.responses`, `.logprobs` (temperature-1 log-probs of the sampled
        tokens: GRPO's old_logprobs), `.state`. `index` keys the random numbers (the same on every rank);
        keyword arguments override the config's rollout section (temperature=0.7, max_tokens=64, ...)."""
        import dataclasses

        from longstraw_mcore.rollout.sampler import sample_group

        rcfg = dataclasses.replace(self.cfg.rollout, **rollout) if rollout else self.cfg.rollout
        return sample_group(self.ddp.module, list(prompt), rcfg, self.cfg.replay, index=index, state=state)

    def step(self, groups) -> dict:
        """One optimizer step on this data-parallel rank's train.groups_per_step prompt groups
        (data/rollouts.RolloutGroup, or the rollouts file's dicts); returns the step's metrics (the same on
        every rank)."""
        from longstraw_mcore.commands.preflight import check_groups
        from longstraw_mcore.data.rollouts import RolloutGroup, parse_group

        n = self.cfg.train.groups_per_step
        if len(groups) != n:
            from longstraw_mcore.config import ConfigError

            raise ConfigError(f"Session.step: {len(groups)} groups; a step takes train.groups_per_step={n} per "
                              "data-parallel rank (each is scaled by 1/groups_per_step)")
        groups = [parse_group(_as_row(g) if isinstance(g, RolloutGroup) else g, i, self.cfg.model.vocab_size)
                  for i, g in enumerate(groups)]   # the rollouts file's checks
        check_groups(self.cfg, groups, has_ref_model=self.trainer.ref_model is not None)
        return self.trainer.run_step(groups)

    @property
    def step_count(self) -> int:
        return self.trainer.step

    def save(self, root: str | Path) -> Path:
        """A checkpoint of the current step under `root` (atomic; `longstraw train --resume` reads it too)."""
        return self.trainer.save(root)

    def resume(self, root: str | Path) -> bool:
        """Load the newest complete checkpoint under `root`; False when there is none."""
        return self.trainer.resume(root)

    def hf_weights(self, dst: int = 0, kept: bool = True):
        """The current weights as (Hugging Face name, full tensor) pairs, one tensor at a time; the tensors
        on rank `dst`, None on the others (collective: every rank iterates to the end). The names and values
        are what `longstraw convert` writes to a Hugging Face directory (the base model's: an adapter's
        tensors are not merged in): last, the tensors kept unchanged beside the decoder (a VLM's vision tower,
        checkpoint/passthrough.py; `kept=False` leaves them out, e.g. for an engine that holds them already)."""
        import torch.distributed as dist

        from longstraw_mcore.checkpoint.convert import hf_tensors
        from longstraw_mcore.families import get_family

        stream = hf_tensors(get_family(self.cfg.model.family), self.ddp.module, self.cfg.model, dst=dst)
        next(stream)
        yield from stream
        source = self.trainer.passthrough
        if kept and source is not None:
            if not dist.is_initialized() or dist.get_rank() == dst:
                yield from source.items()
            else:
                yield from ((name, None) for name in source.names())

    def hf_config(self) -> dict:
        """The config.json `longstraw convert` writes beside `hf_weights()`' tensors."""
        from longstraw_mcore.checkpoint.passthrough import export_config
        from longstraw_mcore.families import get_family

        source = self.trainer.passthrough
        return export_config(get_family(self.cfg.model.family).checkpoint, self.cfg.model,
                             None if source is None else source.config)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _as_dict(cfg) -> dict | None:
    import dataclasses

    return dataclasses.asdict(cfg) if isinstance(cfg, RunConfig) else None


def _as_row(g) -> dict:
    row = {"prompt": g.prompt, "responses": g.responses, "rewards": g.rewards}
    for k in ("old_logprobs", "ref_logprobs", "loss_masks"):
        if getattr(g, k) is not None:
            row[k] = getattr(g, k)
    return row


def _passthrough(args, cfg: RunConfig):
    """The tensors a full-parameter run keeps beside the decoder for export (checkpoint/passthrough.Source, from
    its --hf directory or --load checkpoint), or None (none kept; a LoRA run's steps hold only the adapter)."""
    if cfg.adapter.enabled:
        return None
    from longstraw_mcore.checkpoint.passthrough import Source
    from longstraw_mcore.families import get_family

    if getattr(args, "hf", None):
        return Source.of_hf(get_family(cfg.model.family), args.hf, cfg.model)
    return Source.of_checkpoint(args.load) if getattr(args, "load", None) else None


def second_models(args, cfg: RunConfig, par, policy):
    """((critic DDP, its optimizer) or None, reward model or None) of `--critic` / `--reward-model`; the
    critic trains with train's optimizer settings at ppo.critic_lr (train.lr when 0)."""
    import dataclasses

    from longstraw_mcore.commands.critic import build_second, critic_config, reward_config
    from longstraw_mcore.train.trainer import build_training

    critic = scorer = None
    ccfg = critic_config(cfg, getattr(args, "critic", None), getattr(args, "critic_adapter", None))
    if ccfg is not None:
        lr = cfg.ppo.critic_lr or cfg.train.lr
        ccfg = dataclasses.replace(ccfg, train=dataclasses.replace(ccfg.train, lr=lr))
        critic = build_training(build_second(ccfg, par, args.critic, "critic", trainable=True, policy=policy,
                                             adapter_path=getattr(args, "critic_adapter", None)), ccfg, par)
    mcfg = reward_config(cfg, getattr(args, "reward_model", None), "train")
    if mcfg is not None:
        scorer = build_second(mcfg, par, args.reward_model, "reward", trainable=False)
    return critic, scorer
