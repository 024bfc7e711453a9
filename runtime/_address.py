"""``host:port`` strings, with an IPv6 literal in brackets (``[::1]:50051``, RFC 3986), the form
gRPC targets, URLs and this package's peers all read."""

from __future__ import annotations


def join(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split(address: str) -> tuple[str, int]:
    """(host without brackets, port) of a ``join``-ed address; ValueError when it has no port."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
