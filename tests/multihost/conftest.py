"""Hosts for multi-host tests, on this machine: network namespaces on a bridge, each running its own sshd.

The root namespace holds the bridge at 10.231.<n>.1 (where the controller listens); host ``i`` is namespace
``pscl<tag>h<i>`` at 10.231.<n>.<i+2>, reached by root with a key made for the test session, on that address
only. ``<tag>`` is the test session's pid and ``<n>`` the first subnet no route of this machine uses. Everything
started here is stopped by pid, and the namespaces and bridge are deleted, even when a test fails; those a killed
test session left behind (its pid gone) are deleted when the next one starts, since a bridge left holding a
subnet takes the traffic meant for a new one. Where namespaces cannot be made (not root, no ``ip``, no sshd), the
tests skip with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

import pytest

from pscluster.cluster.reaper import alive

SUBNETS = [f"10.231.{n}" for n in range(256)]
SSHD = "/usr/sbin/sshd"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def why_not() -> str | None:
    """Why namespaces with sshd cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add): run the tests as root"
    for tool in ("ip", "ssh", "scp", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: make multihost-deps installs it"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is missing: make multihost-deps installs openssh-server"
    probe = f"pscl{os.getpid() % 100000}probe"
    made = sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add was refused: {made.stderr.strip()}"
    sh("ip", "netns", "delete", probe, check=False)
    return None


@dataclass
class Hosts:
    """The namespaces, their addresses, and the ssh options that reach them."""

    tmp: str
    tag: str
    subnet: str
    names: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    sshd: list[subprocess.Popen] = field(default_factory=list)

    @property
    def controller_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def bridge(self) -> str:
        return f"pscl{self.tag}br"

    def veth(self, i: int) -> str:
        """The root side of host ``i``'s link: set it down to cut the host off."""
        return f"pscl{self.tag}v{i}"

    @property
    def ssh_args(self) -> list[str]:
        return ["-i", os.path.join(self.tmp, "id"), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5"]

    def launcher_options(self) -> dict:
        """The ``Cluster`` options of the ssh launcher for these hosts."""
        return {"launcher": "ssh", "ssh_args": self.ssh_args,
                "remote_profile_dir": os.path.join(self.tmp, "remote-profile")}

    def cut(self, i: int) -> None:
        sh("ip", "link", "set", self.veth(i), "down")

    def restore(self, i: int) -> None:
        sh("ip", "link", "set", self.veth(i), "up")

    def processes(self) -> list[int]:
        """Every process running in the namespaces (sshd, and the engines it started)."""
        pids = []
        for name in self.names:
            pids += [int(p) for p in sh("ip", "netns", "pids", name, check=False).stdout.split()]
        return pids

    def add(self) -> None:
        i = len(self.names)
        name, address = f"pscl{self.tag}h{i}", f"{self.subnet}.{i + 2}"
        inner = f"pscl{self.tag}n{i}"
        sh("ip", "netns", "add", name)
        self.names.append(name)
        sh("ip", "link", "add", self.veth(i), "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", name)
        sh("ip", "link", "set", self.veth(i), "master", self.bridge, "up")
        for cmd in (("ip", "addr", "add", f"{address}/24", "dev", inner), ("ip", "link", "set", inner, "up"),
                    ("ip", "link", "set", "lo", "up")):
            sh("ip", "netns", "exec", name, *cmd)
        self.addresses.append(address)
        config = os.path.join(self.tmp, f"sshd-{i}.conf")
        with open(config, "w") as f:
            f.write(f"ListenAddress {address}\nHostKey {self.tmp}/host_key\nPidFile {self.tmp}/sshd-{i}.pid\n"
                    f"AuthorizedKeysFile {self.tmp}/authorized_keys\nPermitRootLogin prohibit-password\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                    "PrintMotd no\nSubsystem sftp internal-sftp\n")
        log = os.path.join(self.tmp, f"sshd-{i}.log")
        self.sshd.append(subprocess.Popen(["ip", "netns", "exec", name, SSHD, "-D", "-E", log, "-f", config],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 15
        while (tried := sh("ssh", *self.ssh_args, address, "true", check=False)).returncode != 0:
            if time.monotonic() > deadline or self.sshd[-1].poll() is not None:
                with open(log) as f:
                    logged = f.read()[-2000:]
                raise RuntimeError(f"sshd in {name} did not answer on {address}: ssh said {tried.stderr.strip()!r}; "
                                   f"sshd logged {logged!r}")
            time.sleep(0.2)

    def teardown(self) -> None:
        for pid in self.processes():  # engines started over ssh first, then sshd
            _kill(pid)
        for p in self.sshd:
            _kill(p.pid)
            p.wait(10)
        for name in self.names:
            sh("ip", "netns", "delete", name, check=False)
        sh("ip", "link", "delete", self.bridge, check=False)


def remove_stale() -> None:
    """Delete the namespaces (and what runs in them) and bridges of test sessions whose pid is gone."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        match = re.match(r"pscl(\d+)h\d+\b", line)
        if match and not alive(int(match[1])):
            for pid in sh("ip", "netns", "pids", match[0], check=False).stdout.split():
                _kill(int(pid))
            sh("ip", "netns", "delete", match[0], check=False)  # its veth pair goes with it
    for match in re.finditer(r"^\d+: (pscl(\d+)br):", sh("ip", "-o", "link", "show", check=False).stdout, re.M):
        if not alive(int(match[2])):
            sh("ip", "link", "delete", match[1], check=False)


def free_subnet() -> str:
    """The first of ``SUBNETS`` that no route of this machine uses (another test session may hold one)."""
    routes = sh("ip", "-4", "route", "show", check=False).stdout
    for subnet in SUBNETS:
        if not re.search(rf"(?<![\d.]){re.escape(subnet)}\.", routes):
            return subnet
    raise RuntimeError("every subnet 10.231.0-255.0/24 is routed already: delete the pscl* links (ip link)")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="session")
def hosts(tmp_path_factory):
    """Factory of namespace hosts: ``hosts(3)`` makes sure three exist and returns the ``Hosts``."""
    reason = why_not()
    if reason is not None:
        print(f"\nmulti-host tests skipped: {reason}")
        pytest.skip(reason)
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    tmp = str(tmp_path_factory.mktemp("hosts"))
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(tmp, "host_key"))
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(tmp, "id"))
    shutil.copy(os.path.join(tmp, "id.pub"), os.path.join(tmp, "authorized_keys"))
    remove_stale()
    made = Hosts(tmp=tmp, tag=str(os.getpid()), subnet=free_subnet())
    try:
        sh("ip", "link", "add", made.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{made.controller_ip}/24", "dev", made.bridge)
        sh("ip", "link", "set", made.bridge, "up")

        def ensure(n: int) -> Hosts:
            while len(made.names) < n:
                made.add()
            return made

        yield ensure
    finally:
        made.teardown()
