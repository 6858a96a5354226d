"""The run sections of a config, one dataclass each: replay, the objective, sampling, kernels, the
built-in task and the training loop. Data and their checks only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from longstraw_mcore.config.errors import ConfigError, check_choices, check_ints


BATCH_TOKENS = 8192
"""replay.batch_tokens' default. Batching is the fast path on both devices: one short branch per
micro-step runs small matmuls and pays the per-step work once per branch. Measured warm with
`tools/bench_replay.py --vs-transformers` (2-core CPU, configs/bench-hybrid-256.yaml, float32, P=1,024):
R=128, G=8, detached 1.46 s one branch per micro-step against 0.98 s at 8,192 (one micro-step;
transformers' cache path 1.49 s); R=256, G=16, detached's replay 3.5-4.6 s one per micro-step against
3.0-3.2 s at 512, 1,024, 2,048 and 4,096 tokens (2 to 16 branches per micro-step), exact's 4.4 s against
3.6 / 3.2 / 3.1 / 3.0 s: on the CPU the gain comes from the first few branches per step and a larger
budget costs only memory (JSON: bench_results/cpu_batch_tokens_20261205/). On an H200 (bf16, P=16K,
R=1K, G=8: docs/cpu-gpu.md's GPU run) all 8 branches in one micro-step, 8,192 tokens, halved detached
(1.5 s -> 0.7 s). Memory: a micro-step's activations are one branch's of its tokens, so 8,192 bounds
them at what the published R = 8,192 points already plan for one branch; the 27B configs that are
memory-tight at R = 1,024 set 1,024 (their files say so)."""


@dataclass(kw_only=True)
class ReplayConfig:
    """Branch replay (ARCHITECTURE.md sections 1-2)."""

    mode: Literal["detached", "exact"] = "detached"
    """detached: prompt state held constant (LongStraw's truncated gradient); exact: full-sequence GRPO."""
    chunk_len: int = 4096
    """Capture chunk length (tokens); peak capture activations are one chunk."""
    logprob_chunk: int = 1024
    """Tokens per vocab-parallel log-softmax chunk."""
    batch_tokens: int = BATCH_TOKENS
    """Token budget of a replay micro-step: a group's branches (flat, or the tails below one prefix-tree
    node), consecutive in replay order, share a micro-step while its right-padded batch (branches x the
    longest one's tokens) stays within this many tokens; a longer branch runs alone; 0: one branch per
    micro-step (replay/plan.py `micro_steps`; the planner counts the same steps). Replay activations
    grow with the micro-step's tokens, so this bounds them, as one branch of that length would. See
    BATCH_TOKENS for the default's measurements."""
    attn_probs_budget_mib: float = 0.0
    """A replayed branch keeps its attention probabilities over the prompt for the backward (no score
    recompute: the FLOP minimum) when they fit in this many MiB per rank, summed over this rank's
    attention layers (layers x local heads x branch tokens x prompt tokens x 4 B, 8 B in float64);
    otherwise, and at 0 (default), the backward recomputes them (memory O(branch x block))."""
    keep_prompt_graph_mib: float = 0.0
    """Exact mode: the last capture chunks whose autograd graphs fit in this many MiB per rank (the
    planner's saved-tensor estimate, planner/activations.py) are captured with autograd and their graphs
    kept through the replay, so the prompt sweep runs only their backward instead of recomputing them
    (the same numbers; about one capture's work less). Applies at pipeline size 1 without context
    parallelism, KV groups or state staging, to attention and Gated DeltaNet layers (the Qwen3.5/3.6
    family); elsewhere, and at 0 (default), every chunk is recomputed."""
    prefix_tree: bool = True
    """Responses of a group that begin with the same tokens replay those once, as a prefix tree's
    shared segments (replay/tree.py; the same numbers as replaying each whole); false: every response
    whole from the prompt state."""
    reuse_steps: int = 1
    """`train`: one captured prompt state serves this many optimizer steps, each replaying newly
    sampled branches (needs adapter.prompt=frozen: the state must not depend on trainable weights)."""
    progress_every_s: float = 10.0
    """Rank 0 prints a group's progress (capture, replay, exact mode's sweep: tokens done of total,
    tokens/s, ETA) at most this often, in seconds of wall time; 0: after every step of the plan."""

    def __post_init__(self):
        check_choices(self, "replay")
        check_ints(self, "replay", ("reuse_steps",))
        check_ints(self, "replay", ("batch_tokens",), low=0,
                   words="an integer >= 0 (tokens per replay micro-step; 0 = one branch per micro-step)")
        if not (isinstance(self.progress_every_s, (int, float)) and self.progress_every_s >= 0):
            raise ConfigError(f"replay.progress_every_s={self.progress_every_s!r}: must be a number of seconds >= 0")
        if not self.keep_prompt_graph_mib >= 0:
            raise ConfigError(f"replay.keep_prompt_graph_mib={self.keep_prompt_graph_mib}: must be >= 0 "
                              "(0 = recompute every chunk)")
        if not self.attn_probs_budget_mib >= 0:
            raise ConfigError(f"replay.attn_probs_budget_mib={self.attn_probs_budget_mib}: must be >= 0 "
                              "(0 = always recompute)")
        if self.chunk_len < 1 or self.logprob_chunk < 1:
            raise ConfigError(f"replay.chunk_len={self.chunk_len}, replay.logprob_chunk={self.logprob_chunk}: "
                              "must be >= 1")


@dataclass(kw_only=True)
class GRPOConfig:
    """The GRPO objective (ARCHITECTURE.md section 2); defaults are what a run gets unconfigured."""

    objective: Literal["grpo", "dpo", "ppo"] = "grpo"
    """grpo; dpo (pairs: the best and worst reward of a group); ppo (a critic: `--critic`, the ppo section)."""
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    """GRPO: weight of the k3 KL penalty to the reference policy. DPO: the DPO temperature."""
    std_normalize: bool = True
    """Divide advantages by the group's reward std (torch.std, unbiased); False: mean-only."""
    adv_eps: float = 1e-6
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"

    def __post_init__(self):
        check_choices(self, "grpo")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ConfigError(f"grpo.eps_low={self.eps_low}, grpo.eps_high={self.eps_high}: need 0 <= eps_low < 1, "
                              "eps_high >= 0")
        if self.beta < 0:
            raise ConfigError(f"grpo.beta={self.beta}: must be >= 0")


@dataclass(kw_only=True)
class RolloutConfig:
    """On-policy sampling from the captured prompt state (`longstraw rollout`, `train --online`)."""

    temperature: float = 1.0
    """0: greedy (ties to the lowest id); > 0: softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p."""
    max_tokens: int = 32
    stop_ids: list[int] = field(default_factory=list)
    """A branch ends after sampling any of these (the stop token is kept in the response)."""
    group_size: int = 8
    seed: int = 0
    """Every rank draws the same numbers for (seed, prompt index, step): layouts sample the same tokens."""
    max_prompt_len: int = 1 << 22
    """Prompts longer than this are refused before any model work."""
    branch_at: list[int] = field(default_factory=list)
    """Tree sampling (rollout/tree_sampler.py): token depths at which every response still running splits
    into `branch_k` children; a group then holds up to group_size x branch_k ** len(branch_at)
    responses, sharing their tokens before each split (replayed once in training: replay.prefix_tree)."""
    branch_k: int = 2
    """Children per branching point (with `branch_at`)."""

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ConfigError(f"rollout.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p}: must be in (0, 1]")
        check_ints(self, "rollout", ("max_tokens", "group_size", "max_prompt_len"), words="an integer >= 1")
        if not isinstance(self.stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                          for t in self.stop_ids):
            raise ConfigError(f"rollout.stop_ids={self.stop_ids!r}: must be a list of token ids (integers >= 0)")
        d = self.branch_at
        if not (isinstance(d, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in d)
                and all(a < b for a, b in zip([0] + d, d)) and (not d or d[-1] < self.max_tokens)):
            raise ConfigError(f"rollout.branch_at={d!r}: must be strictly increasing token depths in [1, "
                              f"rollout.max_tokens={self.max_tokens})")
        if not (isinstance(self.branch_k, int) and not isinstance(self.branch_k, bool) and self.branch_k >= 2):
            raise ConfigError(f"rollout.branch_k={self.branch_k!r}: must be an integer >= 2 (children per branching "
                              "point)")


@dataclass(kw_only=True)
class OpsConfig:
    """Which kernel each op runs (ops/dispatch.py)."""

    attention: Literal["auto", "plain", "flash"] = "auto"
    """auto: torch's fused attention ops that return the log-sum-exp: on CPU for every float dtype, on
    CUDA for bf16/fp16 with head dim <= 256; the plain-torch twin otherwise (ops/kernel_choice.py);
    plain / flash force one (flash errors where it cannot run)."""
    gdn: Literal["auto", "plain", "fla"] = "auto"
    """Gated DeltaNet: auto takes flash-linear-attention for CUDA bf16/fp16 where installed (the gpu extra),
    the plain-torch chunked rule otherwise; plain / fla force one."""
    dsa: Literal["auto", "plain", "triton"] = "auto"
    """GLM's DSA indexer top-k and sparse MLA attention: auto takes the project's Triton kernels
    (ops/dsa_triton_indexer.py, ops/dsa_triton_mla.py) for CUDA bf16/fp16/fp32, the plain-torch twins
    (ops/dsa.py) otherwise; plain / triton force one (triton errors where it cannot run; on CPU it runs
    under Triton's interpreter, TRITON_INTERPRET=1)."""

    def __post_init__(self):
        check_choices(self, "ops")


@dataclass(kw_only=True)
class TaskConfig:
    """The built-in task `train --online` and `longstraw rollout --task-prompts` draw prompts from and score
    (tasks/key_recall.py and tasks/tool_lookup.py hold the tasks themselves)."""

    name: Literal["key_recall", "tool_lookup"] = "key_recall"
    """key_recall (tasks/key_recall.py) or tool_lookup (tasks/tool_lookup.py: two turns around a
    loss-masked tool output; key_len and copies do not apply)."""
    min_len: int = 64
    max_len: int = 256
    """Prompt lengths (uniform in [min_len, max_len]): the held-out prompts, and training once any curriculum ends."""
    key_len: int = 2
    n_values: int = 16
    copies: int = 1
    """How many times the key appears in a prompt (at independent random positions)."""
    start_len: list[int] = field(default_factory=list)
    """Length curriculum: [min, max] of the training prompts for the first `hold_steps` steps, then both
    grow geometrically to [min_len, max_len] over `ramp_steps` steps; [] (default): no curriculum."""
    hold_steps: int = 0
    ramp_steps: int = 0
    seed: int = 0
    eval_prompts: int = 32
    """Held-out prompts (greedy decoding, split over data-parallel ranks) scored every `eval_every` steps; 0: none."""
    eval_every: int = 5
    log_samples: int = 0
    """Every this many steps rank 0 prints a few sampled responses (as text with --dataset); 0: never."""

    def __post_init__(self):
        check_choices(self, "task")
        check_ints(self, "task", ("eval_prompts", "eval_every", "hold_steps", "ramp_steps", "seed", "log_samples"), low=0,
                   words="an integer >= 0")
        if not isinstance(self.key_len, int) or not 1 <= self.key_len <= 16:
            raise ConfigError(f"task.key_len={self.key_len!r}: must be an integer in 1..16")
        if not isinstance(self.n_values, int) or self.n_values < 2:
            raise ConfigError(f"task.n_values={self.n_values!r}: must be an integer >= 2")
        if not isinstance(self.copies, int) or self.copies < 1:
            raise ConfigError(f"task.copies={self.copies!r}: must be an integer >= 1")
        shortest = self.copies * self.key_len + 8  # room for the key copies, some distractors and the marker
        if not (isinstance(self.min_len, int) and isinstance(self.max_len, int)
                and shortest <= self.min_len <= self.max_len):
            raise ConfigError(f"task.min_len={self.min_len!r}, task.max_len={self.max_len!r}: need "
                              f"{shortest} <= min_len <= max_len ({shortest} = task.copies * task.key_len + 8)")
        if self.start_len:
            s = self.start_len
            if not (len(s) == 2 and all(isinstance(x, int) for x in s) and shortest <= s[0] <= s[1]
                    and s[0] <= self.min_len and s[1] <= self.max_len):
                raise ConfigError(f"task.start_len={s!r}: must be [min, max] with {shortest} <= min <= max, "
                                  f"min <= task.min_len={self.min_len} and max <= task.max_len={self.max_len}")
        elif self.hold_steps or self.ramp_steps:
            raise ConfigError(f"task.hold_steps={self.hold_steps}, task.ramp_steps={self.ramp_steps} without "
                              "task.start_len: give the curriculum's starting lengths [min, max], or set both to 0")

    def lengths(self, step: int) -> tuple[int, int]:
        """[min, max] of the training prompts at optimizer step `step` (1-based)."""
        if not self.start_len:
            return self.min_len, self.max_len
        frac = min(1.0, max(0, step - self.hold_steps) / self.ramp_steps) if self.ramp_steps else float(
            step > self.hold_steps)
        lo, hi = (round(a * (b / a) ** frac) for a, b in zip(self.start_len, (self.min_len, self.max_len)))
        return lo, max(lo, hi)

    def check_vocab(self, vocab_size: int) -> None:
        need = 2 + self.n_values + 8  # token 0 unused, the marker, the values, at least 8 distractors
        if vocab_size < need:
            task = self.name.replace("_", " ")
            raise ConfigError(f"model.vocab_size={vocab_size} is too small for {task} with task.n_values="
                              f"{self.n_values} (needs >= {need})")


@dataclass(kw_only=True)
class TrainConfig:
    """Optimizer and loop of `longstraw train`; a step is counted in prompt groups."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    groups_per_step: int = 1
    """Prompt groups per optimizer step on each data-parallel rank."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer (Adam state sharded over data parallel)."""
    save_every: int = 0
    """Checkpoint every K steps (0: only at the end when --save is given)."""
    grad_reduction: Literal["step", "micro_step"] = "step"
    """`step`: Megatron DDP (a full-size gradient buffer per rank, reduced once per step) and Megatron's
    optimizer. `micro_step`: every micro-step's gradients reduce-scattered over data x context
    parallel ranks as autograd produces them and kept as float32 shards (ZeRO-2; train/zero2.py),
    AdamW on the shards: no rank holds a full-size gradient between micro-steps."""
    stop_signals: str = "SIGTERM,SIGUSR1"
    """Signals that make `train` stop at the next safe point (between the steps of a group's plan), save
    the last completed step and exit with status 75 (train/stop.py); comma-separated, "" for none."""
    keep_last: int = 0
    """Keep only the newest K published checkpoints under --save (0: keep all)."""
    max_bad_steps: int = 3
    """A step whose loss or gradient norm is not finite is skipped (no update; counted in the metrics);
    this many in a row stop the run with a checkpoint of the last good step (0: never stop)."""
    grad_bucket_mib: float = 64.0
    """micro_step: parameters reduce-scattered together, about this many MiB of float32 gradient per
    collective (a bucket closes at the parameter that reaches it); with memory.grad_offload the largest
    gradient the reduction brings to the device at once."""

    def __post_init__(self):
        check_choices(self, "train")
        if not (isinstance(self.grad_bucket_mib, (int, float)) and not isinstance(self.grad_bucket_mib, bool)
                and self.grad_bucket_mib > 0):
            raise ConfigError(f"train.grad_bucket_mib={self.grad_bucket_mib!r}: must be a number > 0 (MiB per "
                              "reduce-scatter)")
        check_ints(self, "train", ("keep_last", "max_bad_steps"), low=0, words="an integer >= 0")
        for name in filter(None, (n.strip() for n in self.stop_signals.split(","))):
            if name not in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"):
                raise ConfigError(f"train.stop_signals={self.stop_signals!r}: {name!r} is not one of SIGTERM, SIGUSR1, "
                                  "SIGUSR2, SIGINT, SIGHUP")
        if self.lr <= 0 or self.groups_per_step < 1 or self.save_every < 0 or self.clip_grad < 0:
            raise ConfigError(f"train.lr={self.lr}, train.groups_per_step={self.groups_per_step}, "
                              f"train.save_every={self.save_every}, train.clip_grad={self.clip_grad}: need lr > 0, "
                              "groups_per_step >= 1, save_every >= 0, clip_grad >= 0")
