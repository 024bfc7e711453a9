"""``host:port`` strings, with an IPv6 literal in brackets (``[::1]:50051``, RFC 3986), the form
gRPC targets, URLs and this package's peers all read."""

from __future__ import annotations

from atoll.errors import InvalidInput


def join(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split(address: str) -> tuple[str, int]:
    """(host without brackets, port) of a ``join``-ed address; ValueError when it has no port."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def checked(address: str, what: str) -> str:
    """``address`` when it is ``HOST:PORT`` (an IPv6 host in brackets), else InvalidInput saying
    the expected form: gRPC would otherwise read a bare host as one on port 443."""
    host, _, port = address.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536 or bare_ipv6:
        raise InvalidInput(f"{what} {address!r} is not HOST:PORT (e.g. 127.0.0.1:7000, or [::1]:7000)")
    return address
