"""How two ranks of the socket transport meet (runtime/worker/transports/sockets.py): once, at
load, through the job's rendezvous namespace.

Each rank listens on its host's TCP address and, on Linux, on an abstract Unix-domain socket, and
publishes both with a random nonce under ``socket/<rank>``. The higher rank of each pair connects
to the lower: over the Unix-domain socket when both run on one machine (the same boot and network
namespace, so the abstract name is reachable), else over TCP; it presents the nonce, and a
connection without it (anyone who can reach the port but not read the job's store) is dropped.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import struct
import time
import uuid

HELLO = struct.Struct("<q16s")  # the connecting rank, the listener's nonce


def connect_peers(store, rank: int, peers: list[int], host: str, timeout_s: float) -> dict[int, socket.socket]:
    """A connected socket to each rank of ``peers``, by rank; raises OSError, TimeoutError,
    KeyError or ValueError (with the reason) if the pairs cannot meet within ``timeout_s``."""
    nonce = secrets.token_bytes(16)
    machine = machine_id()
    listeners = _listen(host, bool(machine))
    info = {"nonce": nonce.hex(), "machine": machine, "tcp": [host, listeners[0].getsockname()[1]]}
    if len(listeners) > 1:
        info["unix"] = _abstract_name(listeners[1]).hex()
    socks: dict[int, socket.socket] = {}
    try:
        store.set(f"socket/{rank}", json.dumps(info))
        for p in sorted(x for x in peers if x < rank):  # the higher rank connects
            socks[p] = _connect(json.loads(store.get(f"socket/{p}")), machine, rank, timeout_s)
        socks.update(_accept(listeners, {x for x in peers if x > rank}, nonce, timeout_s))
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        for listener in listeners:
            listener.close()
    return socks


def machine_id() -> str:
    """Two processes with the same value can reach each other's abstract Unix-domain sockets:
    the same boot of the same kernel, in the same network namespace ("" where unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def _listen(host: str, unix: bool) -> list[socket.socket]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listeners = [socket.create_server((host.strip("[]"), 0), family=family)]
    if unix:  # abstract namespace: no file to clean up, reachable within the network namespace
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.bind(f"\0atoll-{uuid.uuid4().hex}")
        u.listen()
        listeners.append(u)
    return listeners


def _connect(info: dict, machine: str, rank: int, timeout_s: float) -> socket.socket:
    if machine and info.get("machine") == machine and "unix" in info:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout_s)
            s.connect(bytes.fromhex(info["unix"]))
        except BaseException:
            s.close()
            raise
    else:
        s = socket.create_connection(tuple(info["tcp"]), timeout=timeout_s)
    try:
        s.sendall(HELLO.pack(rank, bytes.fromhex(info["nonce"])))
    except BaseException:
        s.close()
        raise
    return s


def _accept(
    listeners: list[socket.socket], expected: set[int], nonce: bytes, timeout_s: float
) -> dict[int, socket.socket]:
    """A connection from each rank in ``expected``; one without this rank's nonce, or from a
    rank not expected, is closed and the wait goes on."""
    got: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        with selectors.DefaultSelector() as selector:
            for listener in listeners:
                selector.register(listener, selectors.EVENT_READ)
            while len(got) < len(expected):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(expected - set(got))
                    raise TimeoutError(f"ranks {missing} did not connect within {timeout_s:g}s")
                for key, _ in selector.select(remaining):
                    s, _addr = key.fileobj.accept()
                    # a peer sends its hello as soon as it connects: a silent stranger is dropped
                    s.settimeout(max(0.1, min(10.0, deadline - time.monotonic())))
                    try:
                        peer, presented = HELLO.unpack(recv_exact(s, HELLO.size))
                    except (OSError, ConnectionError):
                        s.close()
                        continue
                    if presented != nonce or peer not in expected or peer in got:
                        s.close()
                        continue
                    got[peer] = s
    except BaseException:
        for s in got.values():
            s.close()
        raise
    return got


def _abstract_name(sock: socket.socket) -> bytes:
    name = sock.getsockname()
    return name if isinstance(name, bytes) else name.encode()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a blocking socket; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    got = 0
    while got < n:
        k = sock.recv_into(memoryview(buf)[got:])
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def hang_up(sock: socket.socket) -> None:
    """Shut a connection down and close it: a thread blocked reading it returns at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
