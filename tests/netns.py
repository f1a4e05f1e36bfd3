"""Several "hosts" on this machine, as Linux network namespaces joined by a bridge: the tests' (and the
benchmarks') way to run a job across real network interfaces.

Layout of ``Hosts.create(n)`` (every name carries this process's pid and a counter, so parallel runs and
several clusters in one run never collide)::

    namespace fl<pid>x<k>s  (the switch): bridge br0, ports p0 .. p<n-1>, all up
    namespace fl<pid>x<k>h<i> (host i):   lo up; eth0 (veth, peer p<i>) up, address 10.213.7.<i+1>/24

``Host`` (a namespace and its address, ``LOOPBACK`` for this machine) is what benchmarks place processes
on: ``Hosts.hosts()`` for hosts built here, ``existing_hosts(names)`` for namespaces made by hand.

``SUBNET`` (10.213.7.0/24) is the one private /24 used for tests; its addresses exist only inside these
namespaces (each host's only interface besides lo is its bridge port, so no traffic leaves the machine and
nothing in the root namespace changes), and each set of hosts has a bridge of its own, so concurrent sets
reuse the same addresses without meeting. Each host also
gets ``/etc/netns/<ns>/hosts`` (``ip netns exec`` bind-mounts it over ``/etc/hosts``) mapping this
machine's hostname to the host's address, as on a real machine: software that binds whatever
``gethostname()`` resolves to (gloo, under JAX 0.10) then binds the host's interface, not 127.0.0.1 (which
this machine's /etc/hosts gives; without the file a 2-host collective job fails: gloo advertises
127.0.0.1). ``Hosts.create(n, resolve_hostname=False)`` leaves it out, for testing code that must not
depend on it.

Processes run in a host with ``ip netns exec`` (which execs the command, so the pid is the command's), each
in a session of its own; ``close()`` kills every process group it started (by the pid of a child it has not
reaped, so the group id cannot have been reused), then deletes the namespaces and the hosts files. It runs
from ``with`` / the pytest fixture even when the test fails. ``link_down(i)`` sets host i's eth0 down;
``shape(i, rate=..., delay=...)`` (also ``netem``) puts a qdisc on host i's eth0 (its egress): ``netem``
where the kernel has it, else ``tbf`` for the rate alone (a delay then raises ``NetnsError``, or with
``fallback=True`` is left out and the returned description says so).

A run killed before it could clean up (SIGKILL) leaves its namespaces behind; the next ``Hosts.create``
deletes those whose process (the pid in their name) no longer exists.

Where namespaces cannot be made (not root, no ``ip``, ``ip netns add`` refused) ``Hosts.create`` raises
``NetnsUnavailable`` with the reason; the fixture turns that into ``pytest.skip``.
"""
from __future__ import annotations

import itertools
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import IO, Any, Mapping, Sequence

SUBNET = "10.213.7"  # .0/24: the tests' private network, inside the namespaces only
PREFIX = 24
HOSTS_DIR = pathlib.Path("/etc/netns")
IP_TIMEOUT_S = 20.0  # one `ip`/`tc` command
KILL_WAIT_S = 10.0
_counter = itertools.count()


class NetnsError(RuntimeError):
    """A namespace command failed after the namespaces were made."""


class NetnsUnavailable(NetnsError):
    """Network namespaces cannot be made here; the message says why."""


def _run(*cmd: str) -> str:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {e}") from e
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def check_available() -> None:
    """Raise ``NetnsUnavailable`` naming the reason when namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"network namespaces need root (running as uid {os.geteuid()})")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")


@dataclass(frozen=True)
class Host:
    """Where a process runs: network namespace ``ns`` ("" for this machine's own) and the address its
    endpoints use there."""

    ns: str
    address: str

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run in this host."""
        return ["ip", "netns", "exec", self.ns, *cmd] if self.ns else list(cmd)


LOOPBACK = Host("", "127.0.0.1")


def existing_hosts(names: Sequence[str]) -> list[Host]:
    """Hosts for namespaces made elsewhere (``ip netns add``): each one's first global IPv4 address."""
    check_available()
    hosts = []
    for name in names:
        out = _run("ip", "-n", name, "-4", "-o", "addr", "show", "scope", "global")
        addrs = [line.split()[3].split("/")[0] for line in out.splitlines() if " inet " in line]
        if not addrs:
            raise NetnsError(f"network namespace {name!r} has no global IPv4 address")
        hosts.append(Host(name, addrs[0]))
    return hosts


@dataclass
class Hosts:
    """``n`` namespaced hosts on one bridge; see the module docstring. Build with ``Hosts.create``."""

    prefix: str
    addresses: list[str]
    namespaces: list[str] = field(default_factory=list)  # made so far, the switch first
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    hosts_files: list[pathlib.Path] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}s"

    def ns(self, host: int) -> str:
        """The namespace name of host ``host``."""
        return f"{self.prefix}h{host}"

    def hosts(self) -> list[Host]:
        """Each host as a ``Host`` (namespace and address)."""
        return [Host(self.ns(i), a) for i, a in enumerate(self.addresses)]

    @classmethod
    def create(cls, n: int, resolve_hostname: bool = True) -> Hosts:
        """``n`` (1..250) hosts joined by a bridge, addresses ``SUBNET.1`` .. ``SUBNET.n``; with
        ``resolve_hostname`` False no hosts file is written (the hostname resolves as in the root namespace,
        here to 127.0.0.1: a test of code that must not rely on it). On any failure what was made is
        removed and ``NetnsUnavailable`` is raised."""
        check_available()
        if not 1 <= n <= 250:
            raise ValueError(f"{n} hosts: expected 1..250")
        _remove_stale()
        hosts = cls(prefix=f"fl{os.getpid()}x{next(_counter)}", addresses=[f"{SUBNET}.{i + 1}" for i in range(n)])
        try:
            hosts._build(n, resolve_hostname)
        except NetnsError as e:
            hosts.close()
            raise NetnsUnavailable(f"could not build {n} namespaced hosts: {e}") from e
        return hosts

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self, n: int, resolve_hostname: bool) -> None:
        self._add_ns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        me = socket.gethostname()
        for i, addr in enumerate(self.addresses):
            ns = self.ns(i)
            if resolve_hostname:
                self._write_hosts_file(ns, addr, me)
            self._add_ns(ns)
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
        for i in range(n):
            self._wait_reachable(i)

    def _write_hosts_file(self, ns: str, addr: str, hostname: str) -> None:
        folder = HOSTS_DIR / ns
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "hosts"
        path.write_text(f"127.0.0.1 localhost\n{addr} {hostname}\n")
        self.hosts_files.append(path)

    def _wait_reachable(self, host: int, timeout: float = 10.0) -> None:
        """Wait until host ``host``'s eth0 is up with carrier (its bridge port up)."""
        end = time.monotonic() + timeout
        while True:
            state = _run("ip", "-n", self.ns(host), "-o", "link", "show", "eth0")
            if "LOWER_UP" in state and "state UP" in state:
                return
            if time.monotonic() > end:
                raise NetnsError(f"eth0 of host {host} ({self.ns(host)}) did not come up: {state.strip()}")
            time.sleep(0.05)

    # --- running -----------------------------------------------------------------------------------------

    def popen(self, host: int, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, stdout: IO[Any] | int | None = subprocess.PIPE,
              stderr: IO[Any] | int | None = subprocess.STDOUT) -> subprocess.Popen[str]:
        """Start ``cmd`` in host ``host`` (its own session); killed by ``close`` if still running."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *cmd], env=None if env is None else dict(env),
                             cwd=cwd, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
        self.procs.append(p)
        return p

    def run(self, host: int, *cmd: str) -> str:
        """Run a short command in host ``host``; its stdout (a failure raises ``NetnsError``)."""
        return _run("ip", "netns", "exec", self.ns(host), *cmd)

    def kill_host(self, host: int) -> None:
        """SIGKILL every process this object started in host ``host`` (as when the machine dies)."""
        prefix = ["ip", "netns", "exec", self.ns(host)]
        for p in self.procs:
            if list(p.args[:4]) == prefix:
                _kill(p)

    def link_down(self, host: int) -> None:
        """Set host ``host``'s eth0 down: it is cut off from the others (its processes keep running)."""
        _run("ip", "-n", self.ns(host), "link", "set", "eth0", "down")

    def shape(self, host: int, rate: str | None = None, delay: str | None = None, fallback: bool = False) -> str:
        """Emulate a link on host ``host``'s egress (``rate`` like ``10gbit``, ``delay`` like ``0.1ms``) with
        ``netem``. Where the kernel has no netem (CONFIG_NET_SCH_NETEM), the rate alone goes on ``tbf``; a
        delay then raises ``NetnsError``, or with ``fallback`` is left out. Returns what was installed."""
        netem = ["netem", *(["rate", rate] if rate else []), *(["delay", delay] if delay else [])]
        try:
            _run("ip", "netns", "exec", self.ns(host), "tc", "qdisc", "replace", "dev", "eth0", "root", *netem)
            return "tc qdisc " + " ".join(netem)
        except NetnsError as e:
            if "unknown" not in str(e).lower():
                raise
            if delay and not fallback:
                raise NetnsError(f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so a delay of {delay} "
                                 f"cannot be emulated: {e}") from e
        if not rate:
            return f"nothing (no netem in this kernel: delay {delay} not emulated)"
        # tbf: the bucket must hold at least a timer tick's worth of bytes at the rate
        tbf = ["tbf", "rate", rate, "burst", "4mb", "latency", "50ms"]
        _run("ip", "netns", "exec", self.ns(host), "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf)
        missing = f"; no netem in this kernel: delay {delay} NOT emulated" if delay else ""
        return "tc qdisc " + " ".join(tbf) + missing

    def netem(self, host: int, rate: str | None = None, delay: str | None = None, fallback: bool = False) -> str:
        """``shape`` (named after the tc discipline it prefers)."""
        return self.shape(host, rate=rate, delay=delay, fallback=fallback)

    # --- cleanup -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started here, delete the namespaces and hosts files. Safe to call twice."""
        for p in self.procs:
            _kill(p)
        errors = []
        for name in reversed(self.namespaces):
            self._kill_inside(name)
            try:
                _run("ip", "netns", "del", name)
            except NetnsError as e:
                errors.append(str(e))
        self.namespaces.clear()
        for path in self.hosts_files:
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass
        self.hosts_files.clear()
        if errors:
            raise NetnsError("; ".join(errors))

    @staticmethod
    def _kill_inside(name: str) -> None:
        """SIGKILL what still runs in namespace ``name``: only processes of this object's hosts can be there
        (daemons that left their starter's session, such as a Ray node's raylet)."""
        try:
            pids = _run("ip", "netns", "pids", name).split()
        except NetnsError:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_stale() -> None:
    """Delete namespaces (and hosts files) of this module whose creating process is gone."""
    try:
        listed = _run("ip", "netns", "list")
    except NetnsError:
        return
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    if HOSTS_DIR.is_dir():
        names |= {d.name for d in HOSTS_DIR.iterdir()}
    for name in sorted(names):
        m = re.fullmatch(r"fl(\d+)x\d+(s|h\d+)", name)
        if not m or int(m.group(1)) == os.getpid() or pathlib.Path(f"/proc/{m.group(1)}").exists():
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=IP_TIMEOUT_S)
        shutil.rmtree(HOSTS_DIR / name, ignore_errors=True)


def _kill(p: subprocess.Popen[Any]) -> None:
    """SIGKILL ``p``'s process group (its pid: it leads a session of its own) while ``p`` is unreaped."""
    if p.returncode is None and p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    for stream in (p.stdout, p.stderr):
        if stream is not None and not stream.closed:
            stream.close()
