"""Point-to-point between CPU workers over plain sockets: a Unix-domain socket between two
workers on one machine, TCP between machines.

gloo hands each send and receive to a worker thread of its own, which hands it on to its TCP
loop thread: between two processes of a 2-core machine, a 64-byte round trip costs about 70 us of
CPU on each side. A hand-off between Python threads costs tens of microseconds too, so on the
common path no thread is added: the thread that sends writes the bytes itself, and the thread that
waits reads them. Whichever thread waits on the transport (for a receive, or for room to send)
reads every peer's socket that has data, each message straight into the buffer of the receive
posted for its tag, or, if none is posted yet, into a buffer of its own that the receive copies
from once it is posted (messages of one tag match in order, as gloo's do). One thread reads at a
time; the others wait for it to hand them their message.

A send writes what the socket takes at once. The rest of a message the receiver has not read yet
(a large tensor) goes out from a thread for that peer, in order, which reads the sockets too
whenever no other thread does; its handle completes when the last byte is written. So, as with
gloo, a send never blocks the sending thread, and a transfer completes once the receiver waits
for it, whatever else either side is blocked on: two ranks sending large tensors to each other at
once, or a rank in a collective while its peer sends to it. bench/transport.py measures this
transport against gloo between two processes.

The wire: each message is a header (tag, byte count) and the tensor's bytes, in send order, over
one connection per pair of ranks made at load (socket_setup.py: a Unix-domain socket on one
machine, TCP between machines, each opened with a nonce only the job's ranks can read). Like
gloo's, this channel is not encrypted.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from atoll.worker.transports.gloo import DataPlaneError
from atoll.worker.transports.socket_messages import HEADER, SENT, Message, Queued, Recv, Sent, advance, tensor_view
from atoll.worker.transports.socket_setup import connect_peers, hang_up


@dataclass(eq=False)
class _Peer:
    rank: int
    sock: socket.socket
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    backlog: collections.deque = field(default_factory=collections.deque)  # sends written in the background
    sender: threading.Thread | None = None  # writes the backlog while it is not empty
    posted: dict[int, collections.deque] = field(default_factory=dict)  # tag -> receives waiting
    early: dict[int, collections.deque] = field(default_factory=dict)  # tag -> messages waiting
    header: bytearray = field(default_factory=lambda: bytearray(HEADER.size))
    header_got: int = 0
    into: memoryview | None = None  # where the message being read goes (None: a header is next)
    into_got: int = 0
    reading: Recv | Message | None = None  # what the message completes
    mismatch: str = ""  # the message does not fit its receive's buffer: read, dropped, and failed


class SocketTransport:
    """Point-to-point with ``peers`` (ranks of the job's pipeline) over one socket each."""

    name = "socket"

    def __init__(self, *, store, rank: int, peers: list[int], host: str, timeout_s: float, send_buffer_bytes: int = 0):
        """``send_buffer_bytes``: each socket's send buffer, if not the system's default (the
        kernel caps it at ``net.core.wmem_max``): a message that fits is written at once."""
        self.rank = rank
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # guards the peers' tables, _broken and _reading
        self._changed = threading.Condition(self._lock)  # a message arrived, or the reader left
        self._reading = False  # a thread is reading the sockets (one at a time)
        self._waiting = 0  # threads waiting for the reading one to finish their receive or leave
        self._broken = ""
        self._closed = False
        self._peers: dict[int, _Peer] = {}
        try:
            socks = connect_peers(store, rank, peers, host, timeout_s)
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            raise DataPlaneError(f"rank {rank} could not connect to ranks {sorted(peers)}: {e}") from None
        self._poll = select.poll()
        self._by_fd: dict[int, _Peer] = {}
        for p, s in socks.items():
            s.setblocking(False)
            if send_buffer_bytes:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            if s.family != socket.AF_UNIX:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers[p] = peer = _Peer(p, s)
            self._by_fd[s.fileno()] = peer
            self._poll.register(s, select.POLLIN)

    # ------------------------------------------------------------------ the Transport interface

    def send(self, tensor: torch.Tensor, peer: int, tag: int, inline: bool = False) -> Sent | Queued:
        """Send ``tensor`` to ``peer``; what the socket does not take at once goes out from a thread
        for that peer, or with ``inline`` from this one before it returns (reading the peers
        meanwhile, so a peer sending to this rank at the same time is not blocked): for a caller
        that would wait for the send at once anyway (socket_ring.py), a thread would be pure cost."""
        p = self._peer(peer)
        if tensor.device.type != "cpu":
            raise DataPlaneError(f"socket send to rank {peer}: the tensor is on {tensor.device}, not the CPU")
        tensor = tensor.contiguous()
        views = [memoryview(HEADER.pack(tag, tensor.nbytes)), tensor_view(tensor)]
        what = f"socket send to rank {peer} (tag {tag})"
        with p.send_lock:
            if not p.backlog:  # nothing ahead of it: write what the socket takes now
                try:
                    advance(views, p.sock.sendmsg(views))
                except BlockingIOError:
                    pass
                except OSError as e:
                    self._fail(f"connection to rank {peer} lost ({e})")
                    return Sent(f"{what} failed ({e})")
                if not views:
                    return SENT
            # the rest goes out in the background, after any send still going, so that this
            # thread goes on (to its receives, or a collective a peer needs) as gloo's would
            queued = Queued(what, tensor, views)
            p.backlog.append(queued)
            here = inline and p.sender is None
            if here:
                p.sender = threading.current_thread()  # no thread of its own starts meanwhile
            elif p.sender is None:
                p.sender = threading.Thread(target=self._drain, args=(p,), name=f"socket-send-{peer}", daemon=True)
                p.sender.start()
        if here:
            self._drain(p)
        return queued

    def _drain(self, p: _Peer) -> None:
        """Write ``p``'s queued sends in order, reading the peers meanwhile whenever no other
        thread is (the receiver of a large send may be blocked sending to this rank)."""
        while True:
            with p.send_lock:
                if not p.backlog:
                    p.sender = None
                    return
                queued = p.backlog[0]
            deadline = time.monotonic() + self.timeout_s
            try:
                while queued.views:
                    try:
                        advance(queued.views, p.sock.sendmsg(queued.views))
                    except BlockingIOError:
                        pass
                    if queued.views and not self._until_writable(p, deadline):
                        queued.error = f"{queued.what} timed out after {self.timeout_s:g}s (the peer read nothing)"
                        break
            except OSError as e:
                queued.error = f"{queued.what} failed ({e})"
                self._fail(f"connection to rank {p.rank} lost ({e})")
            with p.send_lock:
                p.backlog.popleft()
                failed = queued.error
                if failed:  # the stream is cut mid-message: nothing after it can be delivered
                    for later in p.backlog:
                        later.error = f"{later.what} failed: the one before it did ({failed})"
                        later.written.set()
                    p.backlog.clear()
            queued.tensor = None
            queued.written.set()

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Recv:
        p = self._peer(peer)
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise DataPlaneError(f"socket receive from rank {peer}: needs a contiguous CPU buffer")
        pending = Recv(self, tensor, f"socket receive from rank {peer} (tag {tag})")
        with self._lock:
            if self._broken:
                raise DataPlaneError(f"socket transport of rank {self.rank}: {self._broken}")
            early = p.early.get(tag)
            if early:
                pending.early = early.popleft()
                if not early:
                    del p.early[tag]
            else:
                p.posted.setdefault(tag, collections.deque()).append(pending)
        return pending

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail("transport closed")
        for peer in self._peers.values():
            hang_up(peer.sock)

    # ------------------------------------------------------------------ reading

    def progress_until(self, item: Recv | Message, deadline: float) -> bool:
        """Read the peers' sockets (or let the thread reading them hand over) until ``item`` is
        done; False at ``deadline``."""
        if item.finished:
            return True
        with self._lock:
            while not item.finished:
                if not self._reading:
                    self._reading = True
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._waiting += 1
                self._changed.wait(remaining)
                self._waiting -= 1
            else:
                return True
        try:
            while not item.finished:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                for fd, _ in self._poll.poll(remaining * 1000):
                    self._read_some(self._by_fd[fd])
            return True
        finally:
            with self._lock:
                self._reading = False
                self._changed.notify_all()

    def _until_writable(self, p: _Peer, deadline: float) -> bool:
        """Wait until ``p``'s socket takes more bytes, reading meanwhile whenever no other thread
        is (the peer may itself be blocked sending to this rank); False at ``deadline``."""
        out = p.sock.fileno()
        while (remaining := deadline - time.monotonic()) > 0:
            with self._lock:
                reading = not self._reading
                self._reading = True
            try:
                poll = select.poll()
                if reading:
                    for other in self._peers.values():
                        if other is not p:
                            poll.register(other.sock, select.POLLIN)
                poll.register(p.sock, select.POLLOUT | (select.POLLIN if reading else 0))
                # not reading: look again soon, in case the thread that reads leaves
                for fd, events in poll.poll(1000 * (remaining if reading else min(remaining, 0.05))):
                    if reading and events & select.POLLIN:
                        self._read_some(self._by_fd[fd])
                    if fd == out and events & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                        return True
            finally:
                if reading:
                    with self._lock:
                        self._reading = False
                        self._changed.notify_all()
        return False

    def _read_some(self, peer: _Peer) -> None:
        """Read what ``peer``'s socket holds now, completing each message as its last byte comes."""
        try:
            while True:
                if peer.into is None:
                    n = peer.sock.recv_into(memoryview(peer.header)[peer.header_got :])
                    if not n:
                        raise ConnectionError("closed by the peer")
                    peer.header_got += n
                    if peer.header_got < HEADER.size:
                        continue
                    peer.header_got = 0
                    self._begin(peer, *HEADER.unpack(peer.header))
                elif peer.into_got < len(peer.into):
                    n = peer.sock.recv_into(peer.into[peer.into_got :])
                    if not n:
                        raise ConnectionError("closed by the peer")
                    peer.into_got += n
                if peer.into is not None and peer.into_got == len(peer.into):
                    self._complete(peer)
                    return  # poll says whether more came (cheaper than recv raising BlockingIOError)
        except BlockingIOError:
            return  # all read for now
        except (OSError, ConnectionError) as e:
            self._fail(f"connection to rank {peer.rank} lost ({e})")

    def _begin(self, peer: _Peer, tag: int, nbytes: int) -> None:
        with self._lock:
            waiting = peer.posted.get(tag)
            pending = waiting.popleft() if waiting else None
            if waiting is not None and not waiting:
                del peer.posted[tag]
            if pending is None:
                pending = Message(nbytes)
                peer.early.setdefault(tag, collections.deque()).append(pending)
        peer.reading, peer.into_got, peer.mismatch = pending, 0, ""
        if isinstance(pending, Message):
            peer.into = memoryview(pending.data)
        elif pending.tensor.nbytes != nbytes:
            peer.mismatch = f"the message has {nbytes} bytes, the buffer {pending.tensor.nbytes}"
            peer.into = memoryview(bytearray(nbytes))  # read and dropped, so the next message lines up
        else:
            peer.into = tensor_view(pending.tensor)

    def _complete(self, peer: _Peer) -> None:
        item, peer.reading, peer.into = peer.reading, None, None
        if peer.mismatch:
            item.error = peer.mismatch
        with self._lock:
            item.finished = True
            if self._waiting:
                self._changed.notify_all()

    def _fail(self, reason: str) -> None:
        """Every receive not yet complete fails with ``reason``, as do later ones."""
        with self._lock:
            self._broken = self._broken or reason
            for peer in self._peers.values():
                unfinished = [r for waiting in peer.posted.values() for r in waiting]
                unfinished += [m for messages in peer.early.values() for m in messages if not m.finished]
                if peer.reading is not None:
                    unfinished.append(peer.reading)
                for item in unfinished:
                    item.error = item.error or reason
                    item.finished = True
                peer.posted.clear()  # a thread reading may still finish the message it is on: harmless
            self._changed.notify_all()

    def _peer(self, rank: int) -> _Peer:
        p = self._peers.get(rank)
        if p is None:
            raise DataPlaneError(f"socket transport of rank {self.rank}: rank {rank} is not a peer")
        return p
