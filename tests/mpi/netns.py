"""A multi-host test bed on one machine: each "host" is a network + mount + UTS namespace.

``HostBed(n)`` makes ``n`` hosts named ``<prefix>h<i>``:

* a network namespace each (``ip netns``), joined by veth pairs to one bridge in the root
  namespace, on a private /24 in 10.0.0.0/8 picked at random among those no route of this
  machine covers; the root namespace gets no address on it, so traffic stays between the
  hosts this bed made;
* a holder process per host, started in that network namespace with a mount and UTS
  namespace of its own: a fresh tmpfs on ``/dev/shm`` (what one host's shared memory sees)
  and its own hostname. Everything else of the file system is shared (the venv, the tests'
  output files under ``/tmp``);
* a launch agent (a shell script for ``--mca plm_rsh_agent``): Open MPI's ``prterun`` calls
  it as it would call ``ssh HOST COMMAND``; it enters that host's namespaces with
  ``nsenter`` and runs the command. ``mpiexec`` itself runs in the first host's namespaces.

Faults: :meth:`HostBed.cut` and :meth:`HostBed.heal` take a host's link down and up again
(a partition between it and the rest); :meth:`HostBed.signal_host` signals every process in
one host; :meth:`HostBed.netem` makes its link slow or lossy where the kernel has ``netem``.

Teardown (:meth:`HostBed.close`, idempotent; the fixtures call it in a finalizer) kills every
process in the hosts' namespaces, deletes the namespaces (their veth ends go with them) and
the bridge. :func:`sweep` removes whatever a killed test run left behind, by the name prefix
every object of every bed shares (``ubmh``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "ubmh"  # every namespace, link and file of a bed starts with it (interface names <= 15)
#: who made each live bed (a file per tag: the maker's pid and start time), so that a sweep
#: removes only the beds of processes that are gone, never a concurrent run's
OWNERS = Path("/run/ubep-beds")
_AGENT = """#!/bin/sh
# ubep test bed launch agent: called as `agent [ssh options] HOST COMMAND...`
while [ "$#" -gt 0 ]; do
  case "$1" in
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
pid=$(cat "{dir}/$host.pid") || exit 255
exec nsenter -t "$pid" {namespaces} -- /bin/sh -c "$*"
"""


def skip_reason() -> str | None:
    """Why namespaces cannot be made here, or ``None``."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI runs as root)"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (iproute2 / util-linux)"
    probe = f"{PREFIX}probe{os.getpid() % 100000}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        return f"cannot make a network namespace here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of this machine overlaps."""
    used = []
    for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(word if word != "default" else "0.0.0.0/32",
                                             strict=False))
    for line in _run("ip", "-4", "-o", "addr").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.append(ipaddress.ip_network(parts[parts.index("inet") + 1], strict=False))
    rng = random.Random(os.urandom(8))
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randrange(1, 255)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free /24 in 10.0.0.0/8")


class HostBed:
    """``num_hosts`` namespaced hosts on a bridge (module docstring)."""

    def __init__(self, num_hosts: int, workdir: Path,
                 monotonic_offsets_s: list[int] | None = None) -> None:
        self.tag = f"{PREFIX}{os.urandom(2).hex()}"
        _claim(self.tag)
        # a time namespace a host whose CLOCK_MONOTONIC runs that many seconds ahead (as two
        # machines' clocks differ: each counts from its own boot)
        self.monotonic_offsets_s = monotonic_offsets_s
        self.hosts = [f"{self.tag}h{i}" for i in range(num_hosts)]
        self.dir = Path(workdir) / self.tag
        self.dir.mkdir(parents=True)
        self.bridge = f"{self.tag}br"
        self.subnet = _free_subnet()
        self.addresses = [str(self.subnet.network_address + 1 + i) for i in range(num_hosts)]
        self._holders: list[subprocess.Popen[bytes]] = []
        self.agent = self.dir / "agent.sh"
        self.agent.write_text(_AGENT.format(dir=self.dir,
                                             namespaces=" ".join(self._namespaces)))
        self.agent.chmod(0o755)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        hosts_file = "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hosts, strict=True))
        (self.dir / "hosts").write_text(hosts_file)
        for i, host in enumerate(self.hosts):
            outer = f"{self.tag}v{i}"
            _run("ip", "netns", "add", host)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", f"{self.tag}p{i}")
            _run("ip", "link", "set", f"{self.tag}p{i}", "netns", host)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            ns = ("ip", "netns", "exec", host)
            _run(*ns, "ip", "link", "set", f"{self.tag}p{i}", "name", "eth0")
            _run(*ns, "ip", "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _run(*ns, "ip", "link", "set", "eth0", "up")
            _run(*ns, "ip", "link", "set", "lo", "up")
            self._start_holder(i, host)

    @property
    def _namespaces(self) -> list[str]:
        """nsenter's flags for a host's namespaces: mount, UTS, network, and time where the
        hosts have clocks of their own (the agent and :meth:`enter` both enter these)."""
        return ["-m", "-u", "-n", *(["-T"] if self.monotonic_offsets_s else [])]

    def _start_holder(self, i: int, host: str) -> None:
        # the holder keeps the mount + UTS namespaces alive; its /etc/hosts names every host.
        # /dev/shm is a limit, not an allocation: 4 GiB holds 2 ranks' Buffers of the
        # benchmark's 512-token shapes (1 GiB did not: bench_multihost)
        script = (f"mount --make-rprivate / && mount -t tmpfs -o size=4g tmpfs /dev/shm && "
                  f"mount --bind {self.dir / 'hosts'} /etc/hosts && hostname {host} && "
                  f"echo $$ > {self.dir / host}.pid.tmp && mv {self.dir / host}.pid.tmp "
                  f"{self.dir / host}.pid && exec sleep 100000")
        clock = (["--time", "--monotonic", str(self.monotonic_offsets_s[i]), "--fork"]
                 if self.monotonic_offsets_s else [])
        proc = subprocess.Popen(["ip", "netns", "exec", host, "unshare", "--mount", "--uts",
                                 *clock, "--propagation", "private", "/bin/sh", "-c", script],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        self._holders.append(proc)
        pid_file = self.dir / f"{host}.pid"
        deadline = time.monotonic() + 20
        while not pid_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"holder of {host} exited: {proc.stderr.read()!r}"
                                   if proc.stderr else f"holder of {host} exited")
            if time.monotonic() > deadline:
                raise RuntimeError(f"holder of {host} did not start")
            time.sleep(0.02)

    def holder_pid(self, host: str) -> int:
        return int((self.dir / f"{host}.pid").read_text())

    def enter(self, host: str) -> list[str]:
        """The command prefix that runs a command in ``host``'s namespaces."""
        return ["nsenter", "-t", str(self.holder_pid(host)), *self._namespaces, "--"]

    def shm_entries(self, host: str) -> list[str]:
        """The names in ``host``'s ``/dev/shm``."""
        out = _run(*self.enter(host), "ls", "-A", "/dev/shm").stdout
        return sorted(out.split())

    def pids(self, host: str) -> list[int]:
        """Processes in ``host``'s network namespace, its holder left out."""
        out = _run("ip", "netns", "pids", host, check=False).stdout
        holder = self.holder_pid(host)
        return [int(p) for p in out.split() if int(p) != holder]

    def signal_host(self, host: str, sig: int) -> list[int]:
        """Send ``sig`` to every process in ``host`` (its holder left out); the pids signalled."""
        hit = []
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                hit.append(pid)
        return hit

    def cut(self, host: str) -> None:
        """Take ``host``'s link to the bridge down: a partition between it and the rest."""
        _run("ip", "link", "set", f"{self.tag}v{self.hosts.index(host)}", "down")

    def netem(self, host: str, spec: list[str]) -> str | None:
        """Shape ``host``'s link with ``tc qdisc ... netem SPEC`` (delay, loss); ``None``, or
        why the kernel does not offer it (no ``sch_netem``)."""
        proc = _run("ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", "eth0", "root",
                    "netem", *spec, check=False)
        if proc.returncode != 0:
            return f"tc netem is not available here: {proc.stderr.strip()}"
        return None

    def heal(self, host: str) -> None:
        _run("ip", "link", "set", f"{self.tag}v{self.hosts.index(host)}", "up")

    def close(self) -> None:
        """Kill every process in the hosts, delete the namespaces, links and files."""
        for host in self.hosts:
            _kill_netns(host)
        for proc in self._holders:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self._holders.clear()
        for i, host in enumerate(self.hosts):
            # deleting the link now: a namespace's own links go only when the kernel gets to it
            _run("ip", "link", "del", f"{self.tag}v{i}", check=False)
            _run("ip", "netns", "del", host, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        (OWNERS / self.tag).unlink(missing_ok=True)

    def __enter__(self) -> HostBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_netns(name: str) -> None:
    """SIGKILL every process in network namespace ``name`` and wait until none is left."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = _run("ip", "netns", "pids", name, check=False).stdout.split()
        if not out:
            return
        for pid in out:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)


def leftovers() -> list[str]:
    """Namespaces and links of any bed still present."""
    found = [n.split()[0] for n in _run("ip", "netns", "list", check=False).stdout.splitlines()
             if n.startswith(PREFIX)]
    for line in _run("ip", "-o", "link", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX):
            found.append(name)
    return found


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot: with the pid, who it is), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _claim(tag: str) -> None:
    OWNERS.mkdir(mode=0o700, parents=True, exist_ok=True)
    (OWNERS / tag).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def _owner_alive(tag: str) -> bool:
    try:
        pid, started = (OWNERS / tag).read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) == started


def sweep() -> list[str]:
    """Remove what beds of earlier, killed runs left (by the name prefix, a live maker's beds
    kept); what was removed."""
    tag_len = len(PREFIX) + 4
    gone = [n for n in leftovers() if not _owner_alive(n[:tag_len])]
    for tag in {n[:tag_len] for n in gone}:
        (OWNERS / tag).unlink(missing_ok=True)
    for name in gone:  # namespaces first: their veth ends go with them
        if name[tag_len:].startswith("h"):
            _kill_netns(name)
            _run("ip", "netns", "del", name, check=False)
    for name in gone:
        if not name[tag_len:].startswith("h"):
            _run("ip", "link", "del", name, check=False)
    return gone
