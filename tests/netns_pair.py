"""Two test hosts on this machine: a pair of Linux network namespaces joined by one veth link.

``NodePair.create(tag)`` makes namespaces ``oz<tag>a`` and ``oz<tag>b``, each with its
loopback up and one end of a veth pair (``v<tag>a`` / ``v<tag>b``, the interface names that
GLOO_SOCKET_IFNAME takes) holding ``10.77.0.1/24`` and ``10.77.0.2/24``: traffic between the two
goes over that link and nowhere else (no route leaves either namespace). ``close()`` deletes
both namespaces, which removes the link with them. Where namespaces cannot be made (not root,
no ``ip`` binary, ``ip netns add`` or the veth pair refused) ``create`` raises
:class:`NamespacesUnavailable` with the reason.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
from typing import List, Sequence

ADDRESSES = ("10.77.0.1", "10.77.0.2")
PREFIX_LEN = 24
IFNAME_MAX_LEN = 15  # Linux's IFNAMSIZ less the terminating NUL


class NamespacesUnavailable(RuntimeError):
    """This machine or user cannot make network namespaces; the message says why."""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _check(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(result.args)} exited {result.returncode}: "
                           f"{result.stderr.strip()}")


@dataclasses.dataclass
class NodePair:
    """Two namespaces, their veth ends and addresses, index 0 and 1 (node rank order)."""

    namespaces: List[str]
    ifnames: List[str]
    addresses: Sequence[str] = ADDRESSES

    @classmethod
    def create(cls, tag: str) -> "NodePair":
        """Make both namespaces and the link; undo what was made if a later step fails."""
        if len(f"v{tag}a") > IFNAME_MAX_LEN:
            raise ValueError(f"tag {tag!r} makes interface names over {IFNAME_MAX_LEN} characters")
        if os.geteuid() != 0:
            raise NamespacesUnavailable(f"network namespaces need root (euid {os.geteuid()})")
        if shutil.which("ip") is None:
            raise NamespacesUnavailable("no `ip` binary (iproute2) on PATH")
        pair = cls([f"oz{tag}a", f"oz{tag}b"], [f"v{tag}a", f"v{tag}b"])
        made = []
        for ns in pair.namespaces:
            result = _ip("netns", "add", ns)
            if result.returncode != 0:
                pair._delete(made)
                raise NamespacesUnavailable(f"`ip netns add {ns}` failed: {result.stderr.strip()}")
            made.append(ns)
        try:
            pair._link()
        except BaseException:
            pair.close()
            raise
        return pair

    def _link(self) -> None:
        (ns_a, ns_b), (if_a, if_b) = self.namespaces, self.ifnames
        result = _ip("link", "add", if_a, "netns", ns_a, "type", "veth",
                     "peer", "name", if_b, "netns", ns_b)
        if result.returncode != 0:  # e.g. a kernel or container without veth
            raise NamespacesUnavailable(f"`{' '.join(result.args)}` failed: {result.stderr.strip()}")
        for ns, ifname, addr in zip(self.namespaces, self.ifnames, self.addresses):
            _check(_ip("-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", ifname))
            _check(_ip("-n", ns, "link", "set", ifname, "up"))
            _check(_ip("-n", ns, "link", "set", "lo", "up"))

    def argv(self, node: int, command: Sequence[str]) -> List[str]:
        """``command`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *command]

    def pids(self, node: int) -> List[int]:
        """The processes that live in node ``node``'s namespace."""
        result = _ip("netns", "pids", self.namespaces[node])
        _check(result)
        return [int(p) for p in result.stdout.split()]

    def kill(self, node: int) -> List[int]:
        """SIGKILL every process in node ``node``'s namespace, as if the machine lost power;
        returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        """Kill what still runs in either namespace and delete both (and the link)."""
        for node in (0, 1):
            try:
                self.kill(node)
            except RuntimeError:
                pass  # that namespace is gone already
        self._delete(self.namespaces)

    @staticmethod
    def _delete(namespaces: Sequence[str]) -> None:
        errors = []
        for ns in namespaces:
            result = _ip("netns", "del", ns)
            if result.returncode != 0 and "No such file" not in result.stderr:
                errors.append(f"`ip netns del {ns}`: {result.stderr.strip()}")
        if errors:
            raise RuntimeError("; ".join(errors))
