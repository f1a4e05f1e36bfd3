"""The namespaced-hosts fixture itself (``tests/netns.py``): three hosts reach each other on their own
addresses, a host whose link is down is cut off, a host's hostname
resolves to its address, and closing removes the namespaces, the hosts files and the processes."""
from __future__ import annotations

import subprocess
import sys
from typing import Callable

import pytest

from tests.netns import Hosts

pytestmark = pytest.mark.serial(waits=True)  # processes on namespaced hosts

SERVE = ("import socket; s = socket.create_server(({addr!r}, 7000)); print('listening', flush=True); "
         "c, _ = s.accept(); c.sendall(socket.gethostbyname(socket.gethostname()).encode())")
CONNECT = ("import socket, sys; c = socket.create_connection(({addr!r}, 7000), timeout=2); "
           "sys.stdout.write(c.recv(64).decode())")


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def test_three_hosts_talk_and_a_downed_link_cuts_one_off(netns_hosts: Callable[..., Hosts]) -> None:
    hosts = netns_hosts(3)
    assert hosts.addresses == ["10.213.7.1", "10.213.7.2", "10.213.7.3"]
    server = hosts.popen(2, [sys.executable, "-c", SERVE.format(addr=hosts.addresses[2])])
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    # the server reports what its hostname resolves to in its host: its own address
    assert hosts.run(0, sys.executable, "-c", CONNECT.format(addr=hosts.addresses[2])) == hosts.addresses[2]
    hosts.link_down(2)
    probe = subprocess.run(["ip", "netns", "exec", hosts.ns(1), sys.executable, "-c",
                            CONNECT.format(addr=hosts.addresses[2])], capture_output=True, text=True, timeout=30)
    assert probe.returncode != 0 and ("timed out" in probe.stderr or "unreachable" in probe.stderr), probe.stderr


def test_close_removes_everything_even_with_processes_running() -> None:
    hosts = Hosts.create(2)
    try:
        sleeper = hosts.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
        made = [hosts.switch, hosts.ns(0), hosts.ns(1)]
        files = list(hosts.hosts_files)
        assert all(name in namespaces() for name in made) and all(f.exists() for f in files)
    finally:
        hosts.close()
    assert sleeper.returncode is not None
    listed = namespaces()
    assert not any(name in listed for name in made)
    assert not any(f.exists() for f in files)
