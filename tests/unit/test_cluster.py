"""Cluster launch logic with a simulated Slurm environment: node-list expansion, head node, ranks per
node (and where the number came from), the master port from the job id, the launcher command each node
runs; and launch/slurm.sbatch end to end on this machine with a stand-in `srun` (one task per "node",
both nodes local), running `longstraw smoke` on 2 gloo ranks, and passing a bad input's exit status 2
out. (A real Slurm of several hosts: tests/dist/test_multinode_slurm.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from longstraw_mcore.cluster import LaunchError, describe, expand_nodelist, job_port, launcher_argv, slurm_allocation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a[1-2]b[8-9]") == ["a1b8", "a1b9", "a2b8", "a2b9"]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("h[098-101]") == ["h098", "h099", "h100", "h101"]
    for bad in ("gpu[3-1]", "gpu[a-b]", ""):
        with pytest.raises(LaunchError):
            expand_nodelist(bad)


def test_allocation_and_launcher_command():
    env = {"SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_GPUS_ON_NODE": "8",
           "SLURM_JOB_ID": "77"}
    a = slurm_allocation(env)
    assert (a.head, a.node_rank, a.procs_per_node, a.world_size, a.procs_from) == ("gpu01", 2, 8, 32,
                                                                                   "SLURM_GPUS_ON_NODE")
    argv = launcher_argv(a, ["validate", "--config", "c.yaml", "parallel.cp=4"], python="py", log_dir="runs/x/logs")
    assert argv == ["py", "-m", "longstraw_mcore.launcher", "--nproc", "8", "--nnodes", "4", "--node-rank", "2",
                    "--master-addr", "gpu01", "--master-port", str(job_port("77")), "--log-dir", "runs/x/logs",
                    "--", "validate", "--config", "c.yaml", "parallel.cp=4"]
    assert launcher_argv(a, ["smoke"], python="py", port=29511)[11:13] == ["--master-port", "29511"]
    # two jobs on one node meet at different ports, all below the ephemeral range
    assert job_port("77") == 20077 and job_port("12077") == 20077 and job_port("4242") != job_port("4243")
    assert all(20000 <= job_port(str(j)) < 32000 for j in (0, 1, 11999, 12000, 987654321))
    cpu = slurm_allocation({k: v for k, v in env.items() if k != "SLURM_GPUS_ON_NODE"} | {"SLURM_NTASKS_PER_NODE": "1"})
    assert cpu.procs_per_node == 1 and "set LONGSTRAW_PROCS_PER_NODE" in describe(cpu)
    assert "8 rank(s) per node from SLURM_GPUS_ON_NODE" in describe(a) and "gpu01:20077" in describe(a)
    assert slurm_allocation(dict(env, SLURM_GPUS_ON_NODE="", SLURM_GPUS_PER_NODE="h100:4")).procs_per_node == 4
    assert slurm_allocation(dict(env, LONGSTRAW_PROCS_PER_NODE="2")).procs_per_node == 2
    for broken, want in ((dict(env, SLURM_JOB_NODELIST=""), "SLURM_JOB_NODELIST is not set"),
                         (dict(env, SLURM_NNODES="3"), "SLURM_NNODES=3 but the node list"),
                         ({k: v for k, v in env.items() if k != "SLURM_GPUS_ON_NODE"}, "ranks per node unknown")):
        with pytest.raises(LaunchError, match=want):
            slurm_allocation(broken)


def test_sbatch_script_runs_two_nodes_with_a_stand_in_srun(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    # srun: one copy of the command per node, SLURM_NODEID set, all at once; the largest exit status (as Slurm's)
    (fake / "srun").write_text("#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n"
                               "for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i \"$@\" & pids+=($!); done\n"
                               "rc=0; for p in \"${pids[@]}\"; do wait $p; c=$?; [ $c -gt $rc ] && rc=$c; done; exit $rc\n")
    (fake / "srun").chmod(0o755)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", SLURM_JOB_NODELIST="localhost,localhost",
               SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=ROOT, LONGSTRAW_PROCS_PER_NODE="1",
               RUN_DIR=str(tmp_path / "run"), RDZV_PORT=str(port), PYTHON=sys.executable, OMP_NUM_THREADS="1",
               LONGSTRAW_DIST_TIMEOUT_S="300")
    r = subprocess.run(["bash", os.path.join(ROOT, "launch/slurm.sbatch"), "smoke", "--config",
                        "configs/qwen3.6-tiny.yaml", "--steps", "1", "--seq-len", "16", "device=cpu"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    out = r.stdout + r.stderr
    assert "2 rank(s)" in out and "[rank 0] [smoke]" in out and "layout tp=1 pp=1 cp=1 dp=2 on 2 cpu rank(s)" in out
    logs = sorted(str(p.relative_to(tmp_path / "run" / "logs")) for p in (tmp_path / "run" / "logs").rglob("*.log"))
    assert logs == ["node0/rank0.log", "node1/rank1.log"], logs  # each rank under its node, by its global rank
    bad = subprocess.run(["bash", os.path.join(ROOT, "launch/slurm.sbatch"), "smoke", "--config",
                          "configs/qwen3.6-tiny.yaml", "model.bogus=1"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    errors = [ln for ln in bad.stderr.splitlines() if "error:" in ln]
    assert bad.returncode == 2 and len(errors) == 1 and "unknown config key(s) ['model.bogus']" in errors[0], \
        (bad.returncode, bad.stderr[-2000:])


def test_mpi_bootstrap_environment():
    """launch_mpi.torch_env: torchrun's variables from MPI's rank, size, per-host split and host names."""
    import pytest

    from longstraw_mcore.launch_mpi import torch_env

    one_host = torch_env(1, 2, 1, 2, ["n1", "n1"], 41000, {})
    assert one_host == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000"}
    two_hosts = torch_env(5, 8, 1, 4, ["gpu07"] * 4 + ["gpu08"] * 4, 41000, {})
    assert (two_hosts["MASTER_ADDR"], two_hosts["RANK"], two_hosts["LOCAL_RANK"]) == ("gpu07", "5", "1")
    site = torch_env(0, 8, 0, 4, ["a"] * 4 + ["b"] * 4, 41000, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (site["MASTER_ADDR"], site["MASTER_PORT"]) == ("10.0.0.1", "29500")
    with pytest.raises(ValueError, match="rank 2 of 2"):
        torch_env(2, 2, 0, 1, ["a", "a"], 1, {})
