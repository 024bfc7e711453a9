"""Remote values: tensors kept on a worker between steps and jobs, moved worker to worker.

A worker keeps a tensor under an id (``client.put``, or a forward step's output kept where it was
made) until it is freed. Another worker that needs it as a step input pulls it straight from the
holder over a TCP connection of the data plane: the bytes never pass through the client or the
controller, which only pass the reference. A data-parallel replica asks for its rows alone
(``rows``: replica ``index`` of ``parts``, cut as ``replica_rows`` cuts them), so each replica's
reader moves its share of a batch, not the whole. Like gloo's, this channel is not encrypted; a
request must carry the cluster token. Every wait has a deadline.

The request is one line, ``TOKEN VALUE_ID`` or ``TOKEN VALUE_ID INDEX/PARTS``; the answer a JSON
header line (dtype, shape, byte count, or an error) and the bytes.
"""

from __future__ import annotations

import json
import socket
import threading

import grpc
import torch

from atoll.core.wire import TensorSpec, dtype_name, replica_rows, tensor_bytes, tensor_from_bytes
from atoll.errors import AtollError, DeadlineExceeded, InvalidInput, NotFound, Unauthenticated, from_status
from atoll.net import address as _address


def _read_exact(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"peer closed the connection with {left} of {n} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_line(conn: socket.socket, limit: int = 4096) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte or len(line) > limit:
            raise ConnectionError("malformed request line")
        line += byte
    return line


class ValueStore:
    """This worker's remote values, and the server its peers pull them from."""

    def __init__(self, host: str, token: str, advertise_host: str | None = None):
        self._token = token
        self._values: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.bytes_served = 0
        """Bytes of values sent to their pullers, counted as each send begins (a failed one takes
        its bytes back), so a puller that has its bytes finds them counted."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server((host.strip("[]"), 0), family=family)
        self.address = _address.join(advertise_host or host, self._server.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._serve, name="values", daemon=True).start()

    def put(self, value_id: str, tensor: torch.Tensor) -> TensorSpec:
        with self._lock:
            if value_id in self._values:
                raise InvalidInput(f"remote value {value_id} already exists on this worker")
            self._values[value_id] = tensor.detach()
        return TensorSpec.of(tensor)

    def get(self, value_id: str, rows: tuple[int, int] = (0, 1)) -> torch.Tensor:
        """The value, or its rows ``rows`` (replica index, replicas) as a view."""
        with self._lock:
            value = self._values.get(value_id)
        if value is None:
            raise NotFound(f"remote value {value_id} is not on this worker (freed, or never made here)")
        return replica_rows(value, *rows)

    def free(self, value_id: str) -> None:
        with self._lock:
            if self._values.pop(value_id, None) is None:
                raise NotFound(f"remote value {value_id} is not on this worker (freed already?)")

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30.0)
            try:
                token, _, asked = _read_line(conn).decode().strip().partition(" ")
                if token != self._token:
                    raise Unauthenticated("bad token")
                value_id, rows = _parse_ask(asked)
                value = self.get(value_id, rows)
                data = tensor_bytes(value)
                header = {"dtype": dtype_name(value.dtype), "shape": list(value.shape), "nbytes": len(data)}
            except AtollError as e:  # a refusal: its reason and its kind's gRPC status code, which
                # ``pull`` raises as that class (atoll.errors.from_status), as a client does for a daemon's
                header, data = {"error": str(e), "code": e.code.name}, b""
            except (OSError, ConnectionError, UnicodeDecodeError):
                return
            # counted before the send: its reader may have it all before this thread runs again
            with self._lock:
                self.bytes_served += len(data)
            try:
                conn.sendall(json.dumps(header).encode() + b"\n" + data)
            except OSError:
                with self._lock:
                    self.bytes_served -= len(data)

    def close(self) -> None:
        self._closed = True
        try:
            self._server.close()
        except OSError:
            pass


def _parse_ask(asked: str) -> tuple[str, tuple[int, int]]:
    """``VALUE_ID`` or ``VALUE_ID INDEX/PARTS`` -> (value id, (index, parts))."""
    value_id, _, rows = asked.partition(" ")
    if not rows:
        return value_id, (0, 1)
    try:
        index, parts = (int(n) for n in rows.split("/"))
    except ValueError:
        raise InvalidInput(f"remote value {value_id}: malformed rows {rows!r} (INDEX/PARTS)") from None
    if not 0 <= index < parts:
        raise InvalidInput(f"remote value {value_id}: rows {index}/{parts} out of range")
    return value_id, (index, parts)


def pull(address: str, token: str, value_id: str, timeout_s: float, rows: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The remote value ``value_id`` (or its rows ``rows``: replica index, replicas) from the
    worker whose value server listens at ``address``. A refusal raises the server's own kind of
    error (``NotFound``, ``InvalidInput``, ``Unauthenticated``); a holder that cannot be read,
    ``NotFound`` (a remote value lives as long as its worker)."""
    ask = value_id if rows[1] <= 1 else f"{value_id} {rows[0]}/{rows[1]}"
    try:
        with socket.create_connection(_address.split(address), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(f"{token} {ask}\n".encode())
            header = json.loads(_read_line(conn))
            data = b"" if "error" in header else _read_exact(conn, int(header["nbytes"]))
    except TimeoutError:
        raise DeadlineExceeded(f"remote value {value_id}: no answer from {address} within {timeout_s}s") from None
    except (OSError, ConnectionError, ValueError) as e:
        raise NotFound(f"remote value {value_id}: cannot read it from {address}: {e}") from None
    if "error" in header:
        code = getattr(grpc.StatusCode, str(header.get("code")), grpc.StatusCode.NOT_FOUND)
        raise from_status(code, f"remote value {value_id} at {address}: {header['error']}")
    return tensor_from_bytes(data, header["dtype"], header["shape"], f"remote value {value_id}")
