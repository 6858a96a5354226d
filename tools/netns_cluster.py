"""A Slurm cluster of N "hosts" on one machine, for the multi-node tests and for trying the launch path by hand.

  python tools/netns_cluster.py up DIR [--hosts 3]     start it; prints the line to `source` for its clients
  python tools/netns_cluster.py run DIR [--host H] -- COMMAND ...   run a command on a host (default: login)
  python tools/netns_cluster.py down DIR               stop it and remove everything it made

Each host (`node1` ... `nodeN`, and `login`, where slurmctld and the clients run) is a network namespace
with a UTS and a mount namespace of its own: its own host name, one address on the cluster's link
(10.213.0.0/24: login .1, nodeK .10+K) and nothing else (no route out, no address of this machine),
its own /etc/hosts naming the cluster's hosts, and its own munged (one key for all). The hosts' links are
veth pairs joined by a bridge inside `login`'s namespace, so nothing is added to this machine's own
network. slurm.conf names the hosts with their addresses; one slurmctld (on login) and one slurmd per
host. The file system is shared, as on a cluster with a shared home: a job sees the checkout where it
was submitted. Every process of the cluster, jobs included, runs inside the namespaces, so `down`
finds them all (`ip netns pids`), kills them, deletes the namespaces (and with them the links) and
removes DIR; `leftovers()` says what would remain (the tests assert it is nothing).

Needs root, iproute2, util-linux (unshare, nsenter), Slurm (slurmctld, slurmd, the clients) and munge;
`missing()` names what is absent. Hard faults for the tests: `kill_host_procs` (SIGKILL a host's
processes matching a pattern) and `cut_link` (the host's link down).

Two traps, measured here: `ip netns exec` remounts /sys for the namespace, and slurmd then finds no cgroup
mount (it fails to start), so commands enter a host with `nsenter` on its holder process instead; and
`nsenter -m` starts in the mount namespace's root, not the caller's directory, so `argv` passes `--wd`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

SUBNET = "10.213.0"
NEEDED = ("ip", "unshare", "nsenter", "munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue")
STATE = "cluster.json"


def missing() -> str | None:
    """Why a cluster cannot be made here, or None."""
    gone = [b for b in NEEDED if shutil.which(b) is None]
    if gone:
        return (f"{', '.join(gone)} not found (scripts/env.sh --test installs Debian's slurm-wlm, munge, "
                "iproute2 and util-linux where apt-get may run as root)")
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"lsprobe-{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)}: exit {r.returncode}: {r.stderr.strip()[-800:]}")
    return r


class Cluster:
    def __init__(self, root: str | Path, hosts: int = 3, cpus: int = 2, tag: str | None = None):
        self.root = Path(root).resolve()
        self.n = hosts
        self.cpus = cpus
        self.tag = tag or uuid.uuid4().hex[:6]
        self.holders: dict[str, int] = {}

    # ---- names --------------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return [f"node{k}" for k in range(1, self.n + 1)]

    @property
    def hosts(self) -> list[str]:
        return ["login", *self.nodes]

    def netns(self, host: str) -> str:
        return f"lsc{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.1" if host == "login" else f"{SUBNET}.{10 + int(host[4:])}"

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict:
        """What a client needs (with `run`): SLURM_CONF."""
        return {"SLURM_CONF": str(self.conf)}

    # ---- up -----------------------------------------------------------------------------------------
    def up(self, timeout_s: float = 60) -> "Cluster":
        why = missing()
        if why:
            raise RuntimeError(why)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / STATE).write_text(json.dumps({"tag": self.tag, "hosts": self.n, "cpus": self.cpus}))
        try:
            self._links()
            self._files()
            for h in self.hosts:
                self._holder(h)
            key = self.root / "munge.key"
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
            for h in self.hosts:
                d = self.root / "hosts" / h / "munge"
                self.run(["munged", f"--key-file={key}", f"--socket={self.root}/munge/munge.sock",
                          f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed",
                          "--force"], host=h, check=True)
            self.run(["slurmctld", "-f", str(self.conf)], host="login", check=True)
            for h in self.nodes:
                self.run(["slurmd", "-f", str(self.conf)], host=h, check=True)
            self.wait_idle(self.nodes, timeout_s)
        except BaseException as e:
            logs = self._log_tails()
            self.down()
            if isinstance(e, RuntimeError):
                raise RuntimeError(f"{e}\n{logs}") from e
            raise
        return self

    def _log_tails(self, lines: int = 8) -> str:
        found = sorted(self.root.glob("*.log")) + sorted(self.root.glob("hosts/*/*.log")) + \
            sorted(self.root.glob("hosts/*/munge/*.log"))
        return "\n".join(f"--- {p.relative_to(self.root)}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                         for p in found)

    def _links(self) -> None:
        for h in self.hosts:
            _sh("ip", "netns", "add", self.netns(h))
            _sh("ip", "-n", self.netns(h), "link", "set", "lo", "up")
        login = self.netns("login")
        _sh("ip", "-n", login, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", login, "addr", "add", f"{self.addr('login')}/24", "dev", "br0")
        _sh("ip", "-n", login, "link", "set", "br0", "up")
        for h in self.nodes:
            _sh("ip", "-n", login, "link", "add", f"v{h}", "type", "veth", "peer", "name", "eth0",
                "netns", self.netns(h))
            _sh("ip", "-n", login, "link", "set", f"v{h}", "master", "br0")
            _sh("ip", "-n", login, "link", "set", f"v{h}", "up")
            _sh("ip", "-n", self.netns(h), "addr", "add", f"{self.addr(h)}/24", "dev", "eth0")
            _sh("ip", "-n", self.netns(h), "link", "set", "eth0", "up")

    def _files(self) -> None:
        r = self.root
        # (the v4-mapped form too: torch's store looks up its clients' names from a dual-stack socket)
        (r / "hosts_file").write_text("127.0.0.1 localhost\n" + "".join(f"{self.addr(h)} {h}\n::ffff:{self.addr(h)} {h}\n"
                                                                         for h in self.hosts))
        (r / "state").mkdir(exist_ok=True)
        (r / "munge").mkdir(exist_ok=True)
        for h in self.hosts:
            (r / "hosts" / h / "munge").mkdir(parents=True, exist_ok=True)
            (r / "hosts" / h / "spool").mkdir(exist_ok=True)
        nodes = "".join(f"NodeName={h} NodeAddr={self.addr(h)} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN\n"
                        for h in self.nodes)
        self.conf.write_text(f"""\
ClusterName=lsc{self.tag}
SlurmctldHost=login({self.addr('login')})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.sock,cred_expire=5
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/hosts/%n/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/hosts/%n/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/hosts/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SlurmdTimeout=30
KillWait=10
JobRequeue=1
{nodes}PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def _holder(self, h: str) -> None:
        """A process that holds host h's UTS and mount namespaces (inside its network namespace): its
        name, its /etc/hosts and its munge socket directory bound over the shared path."""
        r = self.root
        script = (f"hostname {h} && mount --bind {r}/hosts_file /etc/hosts && "
                  f"mount --bind {r}/hosts/{h}/munge {r}/munge && exec sleep infinity")
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.netns(h)}", "unshare", "--uts", "--mount",
                              "--propagation", "private", "sh", "-c", script],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
        t0 = time.monotonic()
        while True:  # ready once the sleep runs under the new name
            if p.poll() is not None:
                raise RuntimeError(f"host {h}: namespaces not made: {p.stderr.read().decode()[-500:]}")
            name = _sh("nsenter", "-t", str(p.pid), "-u", "hostname", check=False).stdout.strip()
            comm = Path(f"/proc/{p.pid}/comm").read_text().strip() if Path(f"/proc/{p.pid}").exists() else ""
            if name == h and comm == "sleep":
                break
            if time.monotonic() - t0 > 10:
                raise RuntimeError(f"host {h}: namespaces not ready in 10 s")
            time.sleep(0.05)
        self.holders[h] = p.pid
        (r / "hosts" / h / "holder.pid").write_text(str(p.pid))

    def _holder_pid(self, h: str) -> int:
        if h not in self.holders:
            self.holders[h] = int((self.root / "hosts" / h / "holder.pid").read_text())
        return self.holders[h]

    # ---- use ----------------------------------------------------------------------------------------
    def argv(self, argv: list[str], host: str = "login", cwd: str | Path | None = None) -> list[str]:
        """`argv` run inside `host`'s namespaces (network, UTS, mount), in `cwd` (default: this one)."""
        if host not in self.hosts:
            raise ValueError(f"host {host!r}: this cluster has {', '.join(self.hosts)}")
        return ["nsenter", "-t", str(self._holder_pid(host)), "-n", "-u", "-m", f"--wd={cwd or os.getcwd()}", "--",
                *argv]

    def run(self, argv: list[str], host: str = "login", env: dict | None = None, check: bool = False,
            timeout: float = 120, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        r = subprocess.run(self.argv(argv, host, cwd), env={**os.environ, **self.env, **(env or {})},
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{host}: {shlex.join(argv)}: exit {r.returncode}: {(r.stderr or r.stdout)[-800:]}")
        return r

    def wait_idle(self, nodes: list[str], timeout_s: float = 60) -> None:
        t0 = time.monotonic()
        while True:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            if all(states.get(h, "").rstrip("*") in ("idle", "mix", "alloc") for h in nodes):
                return
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"nodes not up within {timeout_s:.0f} s: {states}; see {self.root}/hosts/*/slurmd.log")
            time.sleep(0.5)

    def pids(self, host: str) -> list[int]:
        r = _sh("ip", "netns", "pids", self.netns(host), check=False)
        return [int(x) for x in r.stdout.split()]

    def kill_host_procs(self, host: str, pattern: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` to the processes of `host` whose command line contains `pattern`; their pids."""
        hit = []
        for pid in self.pids(host):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if pattern in cmd:
                try:
                    os.kill(pid, sig)
                    hit.append(pid)
                except ProcessLookupError:
                    pass
        return hit

    def cut_link(self, host: str) -> None:
        _sh("ip", "-n", self.netns(host), "link", "set", "eth0", "down")

    # ---- down ---------------------------------------------------------------------------------------
    def _our_netns(self) -> list[str]:
        names = _sh("ip", "netns", "list", check=False).stdout.split("\n")
        return [ln.split()[0] for ln in names if ln.startswith(f"lsc{self.tag}-")]

    def down(self) -> None:
        """Stop every process of the cluster (jobs included), delete its namespaces and links, remove DIR."""
        for _ in range(3):
            victims = [pid for ns in self._our_netns() for pid in
                       (int(x) for x in _sh("ip", "netns", "pids", ns, check=False).stdout.split())]
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not victims:
                break
            time.sleep(0.2)
        for ns in self._our_netns():
            _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (nothing after `down`)."""
        left = [f"network namespace {ns}" for ns in self._our_netns()]
        left += [f"process {pid} ({Path(f'/proc/{pid}/comm').read_text().strip()})" for pid in _procs_naming(self.root)]
        left += [f"link {ln}" for ln in _sh("ip", "-o", "link", "show", check=False).stdout.splitlines()
                 if f"lsc{self.tag}" in ln]
        if self.root.exists():
            left.append(f"directory {self.root}")
        return left


def _procs_naming(root: Path) -> list[int]:
    """Processes whose command line names `root` (daemons started with its config, and their jobs)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if str(root).encode() in (p / "cmdline").read_bytes() and int(p.name) != os.getpid():
                found.append(int(p.name))
        except OSError:
            pass
    return found


def load(root: str | Path) -> Cluster:
    s = json.loads((Path(root) / STATE).read_text())
    return Cluster(root, hosts=s["hosts"], cpus=s["cpus"], tag=s["tag"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/netns_cluster.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["up", "run", "down"])
    p.add_argument("dir")
    p.add_argument("--hosts", type=int, default=3, help="compute hosts (node1 ... nodeN)")
    p.add_argument("--cpus", type=int, default=os.cpu_count(), help="CPUs each host declares to Slurm")
    p.add_argument("--host", default="login", help="run: the host to run on")
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.what == "up":
        if a.hosts < 1:
            print(f"error: --hosts {a.hosts}: need at least 1", file=sys.stderr)
            return 2
        why = missing()
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
        t0 = time.monotonic()
        c = Cluster(a.dir, hosts=a.hosts, cpus=a.cpus).up()
        print(f"[cluster] {c.n} hosts ({', '.join(c.nodes)}) and login up in {time.monotonic() - t0:.1f} s; "
              f"run a client with: python tools/netns_cluster.py run {c.root} -- sbatch ...", file=sys.stderr)
        print(f"export SLURM_CONF={c.conf}")
        return 0
    if not (Path(a.dir) / STATE).is_file():
        print(f"error: {a.dir}: no cluster here ({STATE} missing)", file=sys.stderr)
        return 2
    c = load(a.dir)
    if a.what == "down":
        c.down()
        left = c.leftovers()
        print(f"[cluster] down; left: {', '.join(left) or 'nothing'}", file=sys.stderr)
        return 1 if left else 0
    if not cmd:
        print("error: give the command after --", file=sys.stderr)
        return 2
    return subprocess.run(c.argv(cmd, a.host), env=dict(os.environ, **c.env)).returncode


if __name__ == "__main__":
    sys.exit(main())
