"""The cluster token: where it lives, and the server-side check that runs before any request
is deserialized.

Every daemon rejects a call whose ``authorization`` metadata does not carry the token. The check
sits in a server interceptor, which sees the method name and metadata only; a rejected call is
answered by a handler with no request deserializer, so its payload is never parsed. The one
exception is the standard gRPC health service (``grpc.health.v1.Health``), which load balancers,
Kubernetes probes and ``grpc_health_probe`` call without credentials: it answers SERVING or
NOT_SERVING and reveals nothing else.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import grpc

from atoll.errors import InvalidInput

TOKEN_ENV = "ATOLL_TOKEN"
TOKEN_FILE_ENV = "ATOLL_TOKEN_FILE"
METADATA_KEY = "authorization"


def default_token_file() -> Path:
    return Path(os.environ.get(TOKEN_FILE_ENV) or Path.home() / ".atoll" / "token")


def new_token() -> str:
    return secrets.token_hex(32)


def create_token_file(path: Path, token: str | None = None) -> str:
    """Write ``token`` (default: a fresh random one) to ``path``, readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    token = token or new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def token_file_to_create(token_file: str | os.PathLike | None) -> Path | None:
    """For the controller: the token file it must create (with a fresh token, once its port is
    bound), or None when a token is given by the file or $ATOLL_TOKEN already."""
    if token_file is None and os.environ.get(TOKEN_ENV):
        return None
    path = Path(token_file) if token_file is not None else default_token_file()
    return None if path.exists() else path


def resolve_token(token: str | None = None, token_file: str | os.PathLike | None = None) -> str:
    """The token given, else the one in ``token_file``, $ATOLL_TOKEN, or the default file."""
    if token:
        return token
    if token_file is None and os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = Path(token_file) if token_file is not None else default_token_file()
    if path.exists():
        text = path.read_text().strip()
        if not text:
            raise InvalidInput(f"token file {path} is empty")
        if not (text.isascii() and text.isprintable()):  # gRPC metadata would refuse it, less clearly
            raise InvalidInput(f"token file {path} does not hold a token (one line of printable ASCII)")
        return text
    raise InvalidInput(
        f"no cluster token: {path} does not exist (start the controller first, or pass --token-file / token=...)"
    )


CONTROLLER_KEY = "atoll-controller-key"


def call_metadata(token: str, controller_key: str = "") -> tuple[tuple[str, str], ...]:
    """The token, and for the controller's calls to workers (and workers relaying them) the key
    the controller gave its workers when they registered."""
    if controller_key:
        return ((METADATA_KEY, f"Bearer {token}"), (CONTROLLER_KEY, controller_key))
    return ((METADATA_KEY, f"Bearer {token}"),)


def from_controller(context: grpc.ServicerContext, expected: str) -> bool:
    """Whether a call carries the key of the controller this worker registered with."""
    presented = dict(context.invocation_metadata() or ()).get(CONTROLLER_KEY, "")
    return bool(expected) and hmac.compare_digest(presented.encode(), expected.encode())


PUBLIC_METHOD_PREFIX = "/grpc.health.v1.Health/"
"""Methods every caller may use without the token: the health service's Check and Watch."""


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()
        self._reject = grpc.unary_unary_rpc_method_handler(self._deny)

    @staticmethod
    def _deny(_raw_request: bytes, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(PUBLIC_METHOD_PREFIX):
            return continuation(handler_call_details)
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == METADATA_KEY:
                presented = value
        if hmac.compare_digest(presented.encode(), self._expected):
            return continuation(handler_call_details)
        return self._reject
