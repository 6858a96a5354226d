"""Reading the user's task from the command line, before any process group or model work:
--dataset / --eval-dataset (tasks/text_dataset.py), the tokenizer (--tokenizer, else --hf's directory),
--reward (repeatable) and --env, imported in worker processes (tasks/rewards.py) and each reward
probed once on the first row. Every problem is a ConfigError naming the value (exit 2, one line)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from longstraw_mcore.config import ConfigError


@dataclass
class UserTask:
    cfg: object                  # the run config, rollout.stop_ids defaulted to the tokenizer's EOS
    tokenizer: object
    train: object                # TextDataset
    heldout: object              # TextDataset or None
    pool: object                 # tasks/rewards.UserPool (started)
    reward_names: list[str]
    has_env: bool

    def close(self) -> None:
        self.pool.close()

    def longest_response(self) -> int:
        """Tokens after the prompt a response can reach (the memory check's stand-in): an episode's
        env.max_tokens, else its turns' tokens and as many again for the observations."""
        c = self.cfg
        if not self.has_env:
            return c.rollout.max_tokens
        return c.env.max_tokens or 2 * c.env.max_turns * c.rollout.max_tokens


def prepare(args, cfg, log=print) -> UserTask:
    from longstraw_mcore.tasks.rewards import UserPool
    from longstraw_mcore.tasks.text_dataset import TextDataset, eos_ids, load_tokenizer

    rewards, env = list(getattr(args, "reward", None) or []), getattr(args, "env", None)
    if not rewards and not env:
        raise ConfigError("--dataset needs a reward: --reward module:function (repeatable) and/or --env module:Class")
    if cfg.reward.weights and len(cfg.reward.weights) != len(rewards):
        raise ConfigError(f"reward.weights={cfg.reward.weights}: {len(cfg.reward.weights)} weight(s) for "
                          f"{len(rewards)} --reward function(s); give one per --reward, in order")
    if cfg.grpo.objective == "dpo":
        raise ConfigError("--dataset samples groups of G responses for grpo or ppo; grpo.objective='dpo' needs "
                          "rollouts with a chosen and a rejected response")
    if cfg.rollout.branch_at and env:
        raise ConfigError(f"rollout.branch_at={cfg.rollout.branch_at}: tree sampling does not apply to --env episodes")
    src = getattr(args, "tokenizer", None) or getattr(args, "hf", None)
    if src is None:
        raise ConfigError("--dataset needs the model's tokenizer: --tokenizer DIR (or --hf DIR holding one)")
    tok = load_tokenizer(src, "--tokenizer" if getattr(args, "tokenizer", None) else "--hf")
    if not cfg.rollout.stop_ids:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, stop_ids=eos_ids(tok)))
    limit, vocab = cfg.rollout.max_prompt_len, cfg.model.vocab_size
    train = TextDataset.load(args.dataset, tok, cfg.dataset, limit, vocab, "--dataset")
    heldout = None
    if getattr(args, "eval_dataset", None):
        heldout = TextDataset.load(args.eval_dataset, tok, cfg.dataset, limit, vocab, "--eval-dataset")
    pool = UserPool(cfg.reward.workers, cfg.reward.timeout_s, log, on_failure=cfg.reward.on_failure)
    names = pool.load_rewards(rewards)
    if env:
        pool.load_env(env)
    pool.start()
    try:
        for f, spec in enumerate(rewards):
            why = pool.probe(f, train.rows[0], cfg.rollout.group_size)
            if why:
                log(f"[task] note: --reward {spec} failed on empty responses to row 0 ({why}); the run goes on")
    except BaseException:
        pool.close()
        raise
    if train.truncated:
        log(f"[task] {train.truncated} of {len(train)} prompts cut to their last "
            f"{cfg.dataset.max_prompt_tokens or limit} tokens (dataset.overlong=truncate)")
    return UserTask(cfg, tok, train, heldout, pool, names, bool(env))
