"""Which network interface a sequence-parallel group's process group uses: the one that holds the group's address.

gloo and NCCL pick an interface of their own unless told (gloo: the address the host name resolves to; NCCL: the first
interface it likes), which on a machine whose host name resolves to its LAN address puts a local group's collective
listener on the network. So every rank names its interface before it creates a process group: rank 0 the one that
holds the node's ``master_address`` (loopback for a local group), a worker the one its control connection to rank 0
leaves from. gloo reads ``GLOO_SOCKET_IFNAME`` for each process group it makes (the mesh's later subgroups too);
NCCL reads ``NCCL_SOCKET_IFNAME`` once per process, at its first communicator, so a process keeps the interface of
its first NCCL group (``bind`` refuses another one).

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

GLOO_ENV = "GLOO_SOCKET_IFNAME"
NCCL_ENV = "NCCL_SOCKET_IFNAME"

_nccl_interface: str | None = None  # the interface this process's NCCL took, once it took one
_gloo_before: list[str | None] = []  # what GLOO_ENV held before ``bind`` (``unbind`` gives it back), while bound


@dataclass(frozen=True)
class Interface:
    """A network interface: its name ("lo", "eth0") and the address of it the group uses."""

    name: str
    address: str

    def __str__(self) -> str:
        return f"{self.name} ({self.address})"


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(text.split("%", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def interface_of(address: str) -> Interface:
    """The interface of this machine that holds ``address`` (a host name is resolved first). ValueError naming this
    machine's interfaces when none does (a wildcard such as 0.0.0.0, another machine's address)."""
    import psutil  # ComfyUI's own dependency

    try:
        resolved = socket.getaddrinfo(address.strip().strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
        wanted = _ip(resolved)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Sequence Parallel: cannot resolve the address {address!r} ({exc})") from None
    interfaces = psutil.net_if_addrs()
    for name, entries in interfaces.items():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if _ip(entry.address) == wanted:
                        return Interface(name, str(wanted))
                except ValueError:
                    continue
    held = ", ".join(f"{name} {entry.address}" for name, entries in interfaces.items() for entry in entries
                     if entry.family in (socket.AF_INET, socket.AF_INET6))
    raise ValueError(f"Sequence Parallel: the address {address!r} ({wanted}) is on none of this machine's network "
                     f"interfaces ({held}); set master_address to one of them: 127.0.0.1 when every rank is here, "
                     "else the address the other machines reach")


def bind(address: str, backend: str) -> Interface:
    """Make the process groups this process creates from now on use the interface that holds ``address``
    (``GLOO_SOCKET_IFNAME``; ``NCCL_SOCKET_IFNAME`` for ``backend`` nccl). ValueError when no interface holds it, or
    when NCCL in this process already took another interface (restart the process to change it)."""
    global _nccl_interface
    interface = interface_of(address)
    if backend == "nccl" and _nccl_interface not in (None, interface.name):
        raise ValueError(f"Sequence Parallel: NCCL in this process already uses the network interface "
                         f"{_nccl_interface}, and reads it only once; the address {address!r} is on {interface}. "
                         "Restart ComfyUI to change master_address to another interface")
    if not _gloo_before:
        _gloo_before.append(os.environ.get(GLOO_ENV))
    os.environ[GLOO_ENV] = interface.name
    if backend == "nccl":
        os.environ[NCCL_ENV] = "=" + interface.name  # "=": this name exactly, not every name it begins
        _nccl_interface = interface.name
    return interface


def unbind() -> None:
    """Give ``GLOO_SOCKET_IFNAME`` back the value it had before ``bind`` (rank 0, when its group closes: ComfyUI's
    other children must not inherit it). ``NCCL_SOCKET_IFNAME`` stays: this process's NCCL keeps its interface."""
    if _gloo_before:
        value = _gloo_before.pop()
        if value is None:
            os.environ.pop(GLOO_ENV, None)
        else:
            os.environ[GLOO_ENV] = value
