"""TLS for gRPC (``--tls-cert/--tls-key/--tls-ca`` on the daemons, ``connect(..., tls_ca=...)``).

A cluster uses one CA: every daemon serves a certificate it signed (for the address clients and
peers dial) and trusts it for the daemons it calls; client certificates are optional (a daemon
given ``--tls-ca`` with ``--tls-require-client-cert`` would demand them; not built yet). A daemon
sets its TLS once at start (``use``), and every server and channel of the process follows it; a
client passes its CA explicitly. The token check stays on top of TLS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from atoll.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Tls:
    ca: bytes
    """PEM of the cluster's CA: peers' certificates must chain to it."""
    cert: bytes | None = None
    """PEM certificate this process presents (a daemon's serving certificate)."""
    key: bytes | None = None

    @staticmethod
    def from_files(ca: str | None, cert: str | None = None, key: str | None = None) -> Tls | None:
        if not (ca or cert or key):
            return None
        if not ca or bool(cert) != bool(key):
            raise InvalidInput("TLS needs --tls-ca, and --tls-cert with --tls-key to serve")
        try:
            read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
            return Tls(read(ca), read(cert), read(key))
        except OSError as e:
            raise InvalidInput(f"TLS file: {e}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None:
            raise InvalidInput("a TLS server needs a certificate and key (--tls-cert, --tls-key)")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


_process: list[Tls | None] = [None]


def use(tls: Tls | None) -> None:
    """This daemon's TLS, for every server it binds and channel it opens from now on."""
    _process[0] = tls


def current(explicit: Tls | None = None) -> Tls | None:
    return explicit if explicit is not None else _process[0]
