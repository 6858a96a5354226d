"""Several hosts on one machine: a Slurm cluster of network namespaces (tools/netns_cluster.py: `login`
plus node1..node3, each with its own host name, address, /etc/hosts, munged and slurmd; Debian's
slurm-wlm 22.05) running launch/slurm.sbatch, launch/validate_full_path.sh and launch/mpirun.sh with
2 nodes x 2 CPU ranks on gloo. Every cluster is made for one test and torn down after it, and the test
then asserts that none of its namespaces, links, processes or files is left.

- validate: `sbatch -N2 launch/validate_full_path.sh 4 ...` (TP=2 x PP=2) and, on the same two hosts at
  the same time, `sbatch -N2 launch/slurm.sbatch validate ...` (TP=2 x CP=2) and `mpirun -np 4` across
  them (TP=2 x DP=2, Open MPI launching through Slurm): each equals one rank in float64 (<= 1e-12);
  the two sbatch jobs ran side by side on different derived ports; per-rank logs in node<R>/, console
  lines with global ranks; a bad input exits 2 with one line.
- train: a 2-node run beside a one-node run of the same layout (the reference). `scancel --signal=USR1`
  stops both nodes after the same step with one checkpoint, exit 75, and the job requeues itself and
  resumes. Then node2's ranks are SIGKILLed mid-run: both surviving ranks exit (status 5) within the
  collective timeout, each with one line naming node2 and its ranks; nothing half-written is left as a
  checkpoint; node2 is drained and `scontrol requeue` puts the job on node1 + node3, where it resumes
  from its last checkpoint. Every step's metrics, before and after each restart, equal the one-node run's
  bit for bit.
Skipped, saying why, where namespaces or Slurm cannot be had (scripts/env.sh --test installs them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import netns_cluster  # noqa: E402

TIMEOUT_S = 20  # LONGSTRAW_DIST_TIMEOUT_S of the jobs
PY = sys.executable
TINY = "configs/qwen3.6-tiny.yaml"


@pytest.fixture
def cluster(tmp_path_factory):
    why = netns_cluster.missing()
    if why:
        pytest.skip(f"no namespace cluster here: {why}")
    c = netns_cluster.Cluster(tmp_path_factory.mktemp("cluster"), hosts=3, cpus=2).up()
    try:
        yield c
    finally:
        c.down()
    left = c.leftovers()
    assert not left, f"the cluster left {left}"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    for argv in (["tools/make_hf_model.py", str(d / "hf"), "--config", TINY, "model.dtype=float64"],
                 ["tools/make_rollouts.py", str(d / "v.jsonl"), "--vocab", "512", "--groups", "2", "--prompt-len", "40",
                  "--group-size", "3", "--response-len", "6"],
                 ["tools/make_rollouts.py", str(d / "t.jsonl"), "--vocab", "512", "--groups", "8", "--prompt-len", "40",
                  "--group-size", "3", "--response-len", "6"]):
        subprocess.run([PY, *argv], cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return d


def _env(**extra) -> dict:
    return {"PYTHON": PY, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LONGSTRAW_PROCS_PER_NODE": "2",
            "LONGSTRAW_DIST_TIMEOUT_S": str(TIMEOUT_S), **extra}


def _sbatch(c, out: Path, *args: str, **env) -> str:
    r = c.run(["sbatch", "--parsable", f"--output={out}", *args], env=_env(**env), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _job(c, jid: str) -> dict:
    return dict(re.findall(r"(\w+)=(\S+)", c.run(["scontrol", "show", "job", jid]).stdout))


def _running(c) -> set:
    return set(c.run(["squeue", "-h", "-t", "R", "-o", "%i"]).stdout.split())


def _wait(c, jid: str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=300,
          seen=None) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if seen is not None:
            seen.append(_running(c))
        j = _job(c, jid)
        if j.get("JobState") in states:
            return j
        time.sleep(0.5)
    raise AssertionError(f"job {jid} not in {states} within {timeout} s: {_job(c, jid)}")


def _lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []


def _wait_lines(path: Path, n: int, c, jid: str, timeout=300) -> None:
    t0 = time.monotonic()
    while len(_lines(path)) < n:
        state = _job(c, jid).get("JobState")
        assert time.monotonic() - t0 < timeout and state in ("PENDING", "RUNNING", "REQUEUED"), (state, _lines(path))
        time.sleep(0.2)


def _check_logs(run_dir: Path, text: str) -> None:
    assert sorted(str(p.relative_to(run_dir / "logs")) for p in (run_dir / "logs").rglob("*.log")) == \
        ["node0/rank0.log", "node0/rank1.log", "node1/rank2.log", "node1/rank3.log"]
    ranks = [ln for ln in text.splitlines() if not ln.startswith(("[slurm]", "[check]", "[validate_full_path]"))]
    assert ranks and all(re.match(r"\[rank [0-3]\] ", ln) for ln in ranks), text[-2000:]  # the ranks' own lines


def test_validate_on_two_nodes_equals_one_rank_beside_a_second_job_and_under_mpirun(cluster, inputs, tmp_path):
    from compare_validate import compare

    c, hf, rol = cluster, str(inputs / "hf"), str(inputs / "v.jsonl")
    common = ("device=cpu", "model.dtype=float64")
    # the one-rank reference, outside the cluster, while the cluster runs
    ref = subprocess.Popen([PY, "-m", "longstraw_mcore", "validate", "--hf", hf, "--rollouts", rol, "--out",
                            str(tmp_path / "one"), "--mode", "exact", "--dump-grads", *common], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    two = ("-N2", "-w", "node1,node2", "--oversubscribe")
    jobs = {
        "full_path": _sbatch(c, tmp_path / "a.out", *two, "launch/validate_full_path.sh", "4", TINY,
                             str(tmp_path / "a"), "--hf", hf, "--rollouts", rol, *common, "parallel.tp=2",
                             "parallel.pp=2", RUN_DIR=str(tmp_path / "run_a")),
        "sbatch": _sbatch(c, tmp_path / "b.out", *two, "launch/slurm.sbatch", "validate", "--hf", hf, "--rollouts", rol,
                          "--out", str(tmp_path / "b"), "--mode", "exact", "--dump-grads", *common, "parallel.tp=2",
                          "parallel.cp=2", RUN_DIR=str(tmp_path / "run_b")),
        "mpirun": _sbatch(c, tmp_path / "m.out", *two, "--ntasks-per-node=2", "--wrap",
                          f"bash launch/mpirun.sh 4 validate --hf {hf} --rollouts {rol} --out {tmp_path / 'm'} "
                          f"--mode exact --dump-grads {' '.join(common)} parallel.tp=2",
                          MPIRUN_ARGS="--map-by ppr:2:node"),
        "bad": _sbatch(c, tmp_path / "bad.out", *two, "launch/slurm.sbatch", "smoke", "--config", TINY, "model.bogus=1"),
    }
    seen: list = []
    states = {k: _wait(c, j, seen=seen) for k, j in jobs.items()}
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-2000:]
    texts = {k: (tmp_path / f"{f}.out").read_text() for k, f in (("full_path", "a"), ("sbatch", "b"), ("mpirun", "m"),
                                                                   ("bad", "bad"))}
    side_by_side = any({jobs["full_path"], jobs["sbatch"]} <= s for s in seen)
    ports = {k: re.findall(r"master node1:(\d+)", texts[k]) for k in ("full_path", "sbatch")}
    print(f"jobs {jobs}: {[(k, s['JobState'], s['ExitCode']) for k, s in states.items()]}; full_path and sbatch "
          f"running together: {side_by_side}; their ports {ports}")
    for k in ("full_path", "sbatch", "mpirun"):
        assert states[k]["JobState"] == "COMPLETED" and states[k]["ExitCode"] == "0:0", (k, texts[k][-3000:])
        assert states[k]["NodeList"] == "node[1-2]", states[k]
    assert side_by_side and ports["full_path"] != ports["sbatch"] and all(len(p) == 1 for p in ports.values())
    assert "2 node(s) node1,node2, 2 rank(s) per node from LONGSTRAW_PROCS_PER_NODE, 4 rank(s)" in texts["sbatch"]
    _check_logs(tmp_path / "run_a", texts["full_path"])
    _check_logs(tmp_path / "run_b", texts["sbatch"])
    assert "[mpi] 4 rank(s), 2 per host, rendezvous node1:" in texts["mpirun"], texts["mpirun"][-2000:]
    for k, d in (("full_path", "a"), ("sbatch", "b"), ("mpirun", "m")):
        diff = compare(tmp_path / d, tmp_path / "one")
        print(f"{k} (2 nodes x 2 ranks) vs one rank, float64: loss {diff['loss']:.1e}, logp {diff['logprob_abs']:.1e}, "
              f"grad norm {diff['grad_norm']:.1e}, worst gradient {diff['grad_worst']:.1e} ({diff['grad_worst_name']}), "
              f"normwise {diff['grad_worst_normwise']:.1e}")
        assert max(diff["loss"], diff["logprob_abs"], diff["grad_norm"], diff["grad_worst_normwise"]) <= 1e-12, diff
    errors = [ln for ln in texts["bad"].splitlines() if "error:" in ln and "srun:" not in ln]
    assert states["bad"]["ExitCode"] == "2:0" and len(errors) == 1 and "model.bogus" in errors[0], texts["bad"][-2000:]


def _nodes_of_run(text: str, restart: int) -> str | None:
    """The [slurm] line of a restart: its node list."""
    m = re.search(rf"\(restart {restart}\): 2 node\(s\) (\S+),", text)
    return m.group(1) if m else None


def test_train_on_two_nodes_preempted_then_a_node_lost_requeued_onto_other_hosts_equals_one_node(cluster, inputs,
                                                                                                 tmp_path):
    c, steps = cluster, 6
    train = ("launch/slurm.sbatch", "train", "--config", TINY, "--rollouts", str(inputs / "t.jsonl"), "--steps",
             str(steps), "device=cpu", "parallel.tp=2", "parallel.pp=2", "train.lr=1e-3")
    # the reference: the same layout on one node (4 ranks), alone on node3
    ref = _sbatch(c, tmp_path / "ref.out", "-N1", "-w", "node3", *train, "--save", str(tmp_path / "ck_ref"),
                  "--metrics-out", str(tmp_path / "ref.jsonl"), LONGSTRAW_PROCS_PER_NODE="4",
                  RUN_DIR=str(tmp_path / "run_ref"))
    _wait(c, ref, states=("RUNNING",), timeout=60)
    ck, metrics, out, run = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "t.out", tmp_path / "run"
    jid = _sbatch(c, out, "-N2", *train, "--save", str(ck), "--metrics-out", str(metrics), RUN_DIR=str(run))

    # 1. preemption: USR1 after step 1; both nodes stop after the same step, one checkpoint, exit 75, requeue
    _wait_lines(metrics, 1, c, jid)
    c.run(["scancel", "--signal=USR1", jid], check=True)
    t0 = time.monotonic()
    while "(restart 1)" not in (out.read_text() if out.is_file() else ""):
        assert time.monotonic() - t0 < 120, out.read_text()[-3000:]
        time.sleep(0.3)
    text = out.read_text()
    stopped = [int(s) for s in re.findall(r"\[train\] stopped by SIGUSR1 .*?checkpoint of step (\d+)", text)]
    published = sorted(p.name for p in ck.glob("step_*"))
    print(f"preempted: stopped after step {stopped}, checkpoints {published}")
    assert len(stopped) == 1 and published == [f"step_{stopped[0]:06d}"] and "requeueing job" in text, text[-3000:]

    # 2. node loss: node2's ranks SIGKILLed two steps after the resume
    _wait_lines(metrics, stopped[0] + 2, c, jid)
    killed = c.kill_host_procs("node2", "-m longstraw_mcore train")
    t_kill = time.monotonic()
    j = _wait(c, jid, timeout=TIMEOUT_S + 60)
    took = time.monotonic() - t_kill
    text = out.read_text()
    lost = [ln for ln in text.splitlines() if "error:" in ln and "lost node node2 (ranks 2-3)" in ln]
    print(f"killed {len(killed)} ranks on node2: job {j['JobState']} exit {j['ExitCode']} after {took:.1f} s; {lost}")
    assert len(killed) == 2 and j["JobState"] == "FAILED" and took < TIMEOUT_S, (j, text[-3000:])
    assert sorted(ln.split("]")[0] for ln in lost) == ["[rank 0", "[rank 1"], text[-3000:]
    assert "srun: error: node1: task 0: Exited with exit code 5" in text
    assert sorted(p.name for p in ck.glob("step_*")) == published and not list(ck.glob(".step_*"))

    # 3. requeue onto other hosts: node2 drained, the job lands on node1 + node3 and resumes
    _wait(c, ref, timeout=120)
    c.run(["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=lost in a test"], check=True)
    c.run(["scontrol", "requeue", jid], check=True)
    j = _wait(c, jid, timeout=180)
    text = out.read_text()
    nodes = [_nodes_of_run(text, r) for r in range(3)]
    print(f"requeued: {j['JobState']} exit {j['ExitCode']}, restarts {j['Restarts']}, nodes per run {nodes}")
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0" and j["Restarts"] == "2", (j, text[-3000:])
    assert nodes == ["node1,node2", "node1,node2", "node1,node3"], nodes
    assert text.count("a requeue, resuming") == 2, text[-3000:]

    # every step of every run equals the one-node run's step, bit for bit
    got, want = _lines(metrics), {m["step"]: m for m in _lines(tmp_path / "ref.jsonl")}
    assert sorted(want) == list(range(1, steps + 1))
    order = [m["step"] for m in got]
    keys = ("loss", "grad_norm", "reward_mean", "clip_frac", "kl", "update_ok", "trained_tokens", "state_bytes")
    mismatched = [(m["step"], k, m[k], want[m["step"]][k]) for m in got for k in keys if m[k] != want[m["step"]][k]]
    print(f"steps logged across the three runs {order}; compared {keys}; mismatches {mismatched[:5]}")
    assert order[-1] == steps and set(order) == set(range(1, steps + 1)) and not mismatched
