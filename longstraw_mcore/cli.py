"""The `longstraw` command line (also `python -m longstraw_mcore`); launch under torchrun for >1 rank.

Subcommands (each in commands/):
  train     GRPO / DPO with branch replay: rollouts JSON Lines (or --online: sampled on-policy every
            step), N prompt groups per step, Megatron DDP + optimizer, a metrics line per step,
            atomic checkpoints every K steps, --resume.
  validate  one branch-replay step without an optimizer update: DIR/receipt.json (+ grads.safetensors
            in Hugging Face names with --dump-grads).
  smoke     forward + backward of a next-token loss on random tokens through Megatron's pipeline
            engine (any tp/pp): loss, gradient norm, throughput, memory.
  check     the checks a subcommand runs before starting, alone (config x layout x world size,
            optionally a rollouts file): what launch scripts run first.
  plan      per-rank device memory by component, host memory per rank and node, FLOPs / time by
            phase; does it fit, the largest prompt that does; --suggest: the fastest layout and memory
            switches that fit, with their overrides (no process group, no allocation).
  rollout   sample G responses per prompt from the captured prompt state (temperature, top-p, stop
            ids, seeded so every layout samples the same tokens) -> a rollouts file for train.
Every subcommand takes `--config CFG` and trailing `key=value` overrides (e.g. parallel.tp=2).
Exit status: 0 done; 2 bad input (config, layout, rollouts, checkpoint), with one line naming it;
3 `train` stopped after train.max_bad_steps non-finite steps in a row (a checkpoint of the last good
step kept); 4 a collective did not complete within LONGSTRAW_DIST_TIMEOUT_S while every peer still
runs (gloo; NCCL's watchdog aborts the process, naming the operation); 5 a peer is gone (its
connection closed or its heartbeat stopped: a node lost, a rank killed or frozen), with one line per
surviving rank naming the node and ranks (parallel/peers.py); 75 `train` stopped on a signal
(train.stop_signals) after saving the last completed step: run it again (with --resume, or as the same
Slurm job) to continue; anything else: a crash.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_TIMEOUT = 4
EXIT_PEER_LOST = 5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="longstraw", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("smoke", help="forward + backward of the model on random tokens")
    s.add_argument("--config", default=None)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--hf", default=None, help="Hugging Face directory to load weights from")
    g.add_argument("--load", default=None, help="Megatron checkpoint directory to load weights from")
    s.add_argument("--batch", type=int, default=2)
    s.add_argument("--seq-len", type=int, default=64)
    s.add_argument("--steps", type=int, default=2)
    s.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches of --batch x --seq-len per step (interleaved stages: at least the "
                   "schedule's fewest)")
    s.add_argument("--metrics-out", default=None, help="append one JSON line per step (rank 0)")
    s.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. parallel.tp=2")
    s.set_defaults(command="smoke")

    def replay_args(sp, need_weights, online=False):
        sp.add_argument("--config", default=None)
        g = sp.add_mutually_exclusive_group(required=need_weights)
        g.add_argument("--hf", default=None, help="Hugging Face directory (config.json + *.safetensors)")
        g.add_argument("--load", default=None, help="Megatron checkpoint directory")
        if online:
            d = sp.add_mutually_exclusive_group(required=True)
            d.add_argument("--rollouts", default=None, help="JSON Lines prompt groups")
            d.add_argument("--online", action="store_true",
                           help="sample every step's groups from the current policy on the config's task (on-policy)")
        else:
            sp.add_argument("--rollouts", required=True, help="JSON Lines prompt groups")
        r = sp.add_mutually_exclusive_group()
        r.add_argument("--ref-hf", default=None, help="reference model (HF dir) for the KL term / DPO margin")
        r.add_argument("--ref-load", default=None, help="reference model (Megatron checkpoint)")
        sp.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory (adapter_config.json + "
                        "adapter_model.safetensors) on the frozen base; only it trains")
        sp.add_argument("--critic", default=None, help="grpo.objective=ppo: the critic, a Hugging Face directory in "
                        "the token-classification layout with one label (Qwen3_5ForTokenClassification), or "
                        "`policy`: the policy's starting weights with a new value head")
        sp.add_argument("--critic-adapter", default=None, help="a PEFT LoRA directory of the critic (PEFT's "
                        "token-classification task: its value head `score` kept whole) on --critic's frozen base")
        sp.add_argument("--reward-model", default=None, help="score each response with this model (the sequence-"
                        "classification layout with one label, Qwen3_5ForSequenceClassification) in place of "
                        "the rollouts' rewards")
        sp.add_argument("--force", action="store_true",
                        help="run even when `longstraw plan` says it does not fit a rank's memory")
        sp.add_argument("overrides", nargs="*", help="key=value config overrides")

    def task_args(sp):
        sp.add_argument("--dataset", default=None, help="your own prompts: JSON Lines rows with \"prompt\" (text) or "
                        "\"messages\" (chat); other fields go to the reward (with --online)")
        sp.add_argument("--eval-dataset", default=None, help="held-out rows: greedy reward every task.eval_every steps")
        sp.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer directory (default: --hf's)")
        sp.add_argument("--reward", action="append", default=None, metavar="MODULE:FUNCTION",
                        help="function(responses, row) -> one float per response; a module path or a .py file; "
                        "repeatable (weights: reward.weights=[...])")
        sp.add_argument("--env", default=None, metavar="MODULE:CLASS",
                        help="multi-turn environment: reset(row), step(text) -> (observation, done, reward)")

    t = sub.add_parser("train", help="GRPO/DPO training with branch replay")
    replay_args(t, need_weights=False, online=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--save", default=None, help="checkpoint directory")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint under --save")
    t.add_argument("--metrics-out", default=None, help="append one JSON line of metrics per step (rank 0)")
    t.add_argument("--tensorboard", default=None, help="also write TensorBoard event files here (rank 0; the "
                   "`tensorboard` extra)")
    task_args(t)
    t.set_defaults(command="train")
    v = sub.add_parser("validate", help="one branch-replay step without an optimizer update")
    replay_args(v, need_weights=True)
    v.add_argument("--out", required=True)
    v.add_argument("--mode", choices=["detached", "exact"], default=None)
    v.add_argument("--dump-grads", action="store_true")
    v.set_defaults(command="validate")
    ro = sub.add_parser("rollout", help="sample G responses per prompt from the captured prompt state -> rollouts file")
    ro.add_argument("--config", default=None)
    g = ro.add_mutually_exclusive_group()
    g.add_argument("--hf", default=None, help="Hugging Face directory (config.json + *.safetensors)")
    g.add_argument("--load", default=None, help="Megatron checkpoint directory")
    src = ro.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", default=None,
                     help='JSON Lines {"prompt": [ids], "key": [ids]?}; with a key the reward is key recall\'s')
    src.add_argument("--task-prompts", type=int, default=None, help="draw this many prompts from the config's task")
    src.add_argument("--dataset", default=None, help="your own prompts (JSON Lines, text or chat), scored by --reward")
    ro.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer directory (default: --hf's)")
    ro.add_argument("--reward", action="append", default=None, metavar="MODULE:FUNCTION", help="with --dataset")
    ro.add_argument("--env", default=None, metavar="MODULE:CLASS", help="with --dataset: multi-turn episodes")
    ro.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory on the base model")
    ro.add_argument("--out", required=True, help="the rollouts file to write (JSON Lines, the format train reads)")
    ro.add_argument("overrides", nargs="*", help="key=value config overrides (rollout.temperature=0.7, ...)")
    ro.set_defaults(command="rollout")
    pl = sub.add_parser("plan", help="per-rank memory and FLOPs of a run; does it fit, the largest prompt that does")
    pl.add_argument("--config", default=None)
    pl.add_argument("--hf", default=None, help="take the model from this Hugging Face directory's config.json")
    pl.add_argument("--prompt-len", type=int, required=True)
    pl.add_argument("--response-len", type=int, default=None, help="(or --tree)")
    pl.add_argument("--group-size", type=int, default=None, help="(or --tree)")
    pl.add_argument("--tree", default=None, help="WIDTHS:LENGTHS: the group as a full prefix tree (widths[d] children "
                    "per node at depth d, segments of lengths[d] tokens): its shared segments replayed once")
    pl.add_argument("--gpus", type=int, required=True, help="ranks of the run (data parallel = the rest)")
    pl.add_argument("--device", default="H20-96GB",
                    help="device profile: H20-96GB, H20-141GB, H100-80GB, H200-141GB")
    pl.add_argument("--device-gib", type=float, default=None, help="override the profile's memory (GiB)")
    pl.add_argument("--host-gib", type=float, default=None,
                    help="host memory per node, GiB (default 2048: an 8-GPU H20 server's DDR)")
    pl.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node for the host total (default 8)")
    pl.add_argument("--efficiency", type=float, default=None,
                    help="one fraction of the bf16 peak for every phase of the time estimate (default: each "
                    "phase's figure from the device table, planner/efficiency.py: measured on H200, derived elsewhere)")
    pl.add_argument("--suggest", action="store_true",
                    help="search layouts and memory switches for the fastest plan that fits; print its overrides")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--png", default=None, help="also draw the per-rank memory against the device's (PNG file)")
    pl.add_argument("overrides", nargs="*", help="key=value config overrides")
    pl.set_defaults(command="plan")
    c = sub.add_parser("check", help="check a config for a subcommand without starting anything")
    c.add_argument("--config", default=None)
    c.add_argument("--hf", default=None, help="take the model from this Hugging Face directory's config.json")
    c.add_argument("--cmd", choices=["train", "validate", "smoke"], default="train",
                   help="the subcommand to check for (default: train)")
    c.add_argument("--world-size", type=int, default=None, help="ranks the launch will start")
    c.add_argument("--rollouts", default=None, help="also validate this rollouts file")
    c.add_argument("--with-ref-model", action="store_true", help="a reference model will be given")
    c.add_argument("overrides", nargs="*", help="key=value config overrides")
    c.set_defaults(command="check")
    return p


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The command line, its key=value overrides anywhere among the options (argparse alone takes them only
    in one run: `--reward f a=1 --steps 3 b=2` would refuse b=2)."""
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if x.startswith("-") or "=" not in x]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(getattr(args, "overrides", None) or []) + extra
    return args


def quiet_expected_warnings() -> None:
    """What every rank of a CPU run used to print and nobody needs: Megatron's warnings that TE / apex /
    absl are absent (the expected CPU set-up), torch's "No CUDA runtime is found" (logged when Megatron
    imports torch.utils.cpp_extension), the deprecation of all_gather_into_tensor that Megatron 0.19
    still calls, Megatron's note that its "async" save is deprecated (logged for every synchronous
    dist-checkpoint save), and torch.distributed.checkpoint's two warnings on loading one."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # torch.distributed.checkpoint on every rank's load of Megatron's dist checkpoint: the process group
    # is there (its check looks at another one), and the argument order is Megatron's to follow
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
    warnings.filterwarnings("ignore", message=r"The argument order of load has been changed")

    class _NotAsyncDeprecation(logging.Filter):
        def filter(self, record):
            return "async save is deprecated" not in record.getMessage()
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").addFilter(_NotAsyncDeprecation())


def _console_gone(e: BaseException) -> bool:
    """Whether a write failed because the reader is gone for good (a closed pipe or terminal), not for a
    moment (EAGAIN) nor for what was written (an encoding error)."""
    if isinstance(e, (BrokenPipeError, ConnectionResetError)):
        return True
    if isinstance(e, OSError):
        import errno

        return e.errno in (errno.EIO, errno.ENXIO, errno.EBADF)
    return isinstance(e, ValueError) and not isinstance(e, UnicodeError) and "closed file" in str(e)


class Console:
    """A console stream whose reader's end does not end the run: a write or flush that fails because the pipe or
    terminal behind it is gone (`| head` under a launcher that lets ranks write to it directly, a closed
    terminal under nohup) silences the stream for the rest of the process, its file descriptor pointed at
    /dev/null so that the interpreter's own flush at exit fails neither. Any other error is raised as before.
    What the run writes to files (checkpoints, metrics, receipts) is unaffected. (A rank whose launcher dies
    is ended by the launcher's death signal, not by its console: launcher.die_with_launcher.)"""

    def __init__(self, stream):
        self.stream, self.lost = stream, False

    def _gone(self) -> None:
        self.lost = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self.stream.write(text)
            except (OSError, ValueError) as e:
                if not _console_gone(e):
                    raise
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except (OSError, ValueError) as e:
                if not _console_gone(e):
                    raise
                self._gone()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def tolerant_console() -> None:
    """stdout and stderr as `Console`s (once per process): the console is optional."""
    for name in ("stdout", "stderr"):
        if not isinstance(getattr(sys, name), Console):
            setattr(sys, name, Console(getattr(sys, name)))


def main(argv=None) -> int:
    import faulthandler
    import importlib

    from longstraw_mcore.launcher import die_with_launcher

    die_with_launcher()
    tolerant_console()
    # a rank killed inside native code (an abort in gloo's threads, a segfault) leaves the Python stack of
    # every thread on its stderr, so the run's output says where; the launcher names the rank and the signal
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    quiet_expected_warnings()
    args = parse(build_parser(), argv)
    from longstraw_mcore.checkpoint.common import CheckpointError
    from longstraw_mcore.commands.common import is_rank0
    from longstraw_mcore.config import ConfigError
    from longstraw_mcore.data.rollouts import RolloutError

    from longstraw_mcore.commands.train import TrainingDiverged

    ours = not _dist_up()  # (a process group the caller made stays open)
    try:
        return importlib.import_module(f"longstraw_mcore.commands.{args.command}").run(args)
    except (ConfigError, CheckpointError, RolloutError) as e:
        if is_rank0():
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except TrainingDiverged as e:
        if is_rank0():
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except RuntimeError as e:
        code = collective_failure(e)
        if code is None:
            raise
        return code
    finally:
        if ours:
            _shutdown()


def collective_failure(e: RuntimeError) -> int | None:
    """A collective that failed (a peer's connection closed, or the timeout): one line, and the exit status
    (EXIT_PEER_LOST when a peer is gone, naming it; EXIT_TIMEOUT when every peer still beats); None for
    any other error."""
    from longstraw_mcore.parallel import peers

    timed_out = "Timed out" in str(e)
    if not (timed_out or peers.is_connection_lost(e)):
        return None
    lost = peers.diagnose()
    if lost is not None or not timed_out:
        print(f"error: {peers.lost_line(lost or 'a peer', _where(e), peers.cause(e))}", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    print(f"error: {collective_timeout(e, peers.beating())}", file=sys.stderr, flush=True)
    return EXIT_TIMEOUT


def _shutdown() -> None:
    """Close the process groups this command made before the interpreter exits (a local operation: no
    peer is waited for). Left to interpreter teardown, gloo's threads were once seen to end a finished
    rank with "terminate called without an active exception" (exit 134)."""
    if _dist_up():
        from longstraw_mcore.parallel import peers

        peers.stop()
        sys.modules["torch.distributed"].destroy_process_group()


def _dist_up() -> bool:
    """Whether a default process group exists (without importing torch for commands that never do)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def collective_timeout(e: BaseException, beating: bool = False) -> str:
    """One line for a collective that did not complete in time (gloo raises it; NCCL's watchdog aborts the
    process with its own line naming the operation): this rank, the timeout, and where the collective was
    called (the innermost frames in Megatron and in this package)."""
    limit = os.environ.get("LONGSTRAW_DIST_TIMEOUT_S", "the default")
    return (f"rank {os.environ.get('RANK', '0')}: a collective did not complete within {limit} s "
            f"(LONGSTRAW_DIST_TIMEOUT_S) in {_where(e)}: "
            + ("every peer's heartbeat still runs, so a peer is stuck elsewhere" if beating else
               "a peer rank stopped or is stuck elsewhere")
            + f"; its own output says why ({str(e).splitlines()[0][-120:]})")


def _where(e: BaseException) -> str:
    """Where the failed collective was called: the innermost frames in Megatron and in this package."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    megatron = [f for f in frames if f"{os.sep}megatron{os.sep}" in f.filename]
    ours = [f for f in frames if f"{os.sep}longstraw_mcore{os.sep}" in f.filename
            and not f.filename.endswith("cpu_compat.py")]  # (its torch-function mode sees every call)
    return "; ".join(dict.fromkeys(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})"
                                   for f in (megatron[-1:] + ours[-1:]))) or "an unknown call"


if __name__ == "__main__":
    sys.exit(main())
