"""Running the controller daemon: the gRPC server (the data plane's rendezvous too), health checks, shutdown."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.controller.service import ControllerService
from atoll.core.graphs import forbid_pickle
from atoll.net import address as _address
from atoll.net.auth import create_token_file, new_token, resolve_token, token_file_to_create
from atoll.net.rpc import Health, make_server

log = logging.getLogger("atoll.controller")


@dataclass(kw_only=True, slots=True)
class ControllerConfig:
    host: str = "127.0.0.1"
    """Address to bind (gRPC, the data-plane rendezvous included); 0.0.0.0 to serve other hosts."""
    port: int = 0
    """gRPC port; 0 picks a free one (the bound address is printed)."""
    token_file: str | None = None
    """Cluster token file; created with a fresh token if missing. Default: ~/.atoll/token."""
    heartbeat_interval_s: float = 1.0
    """How often workers report in."""
    heartbeat_timeout_s: float = 5.0
    """Silence after which a worker is declared dead and its jobs failed."""
    step_timeout_s: float = 600.0
    """Deadline of one step's RPC to each worker."""
    lease_timeout_s: float = 30.0
    """Silence of a client session after which its jobs (not detached ones) are closed."""
    status_grace_s: float = 60.0
    """How long a dead worker or a failed job still shows in status (``atoll status --all``: always)."""
    allow_pickle: bool = False
    """Let torch.load unpickle arbitrary objects inside submitted programs (unsafe)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP at ``host:metrics_port/metrics`` (0 picks a free port;
    None: no metrics server). controller/cluster/metrics.py lists them."""
    state_dir: str | None = None
    """Where the controller records its workers and jobs (SQLite, controller/statedir.py): restarted
    on the same directory, it takes its jobs back (controller/recovery.py). None: in memory only."""


class ControllerDaemon:
    def __init__(self, config: ControllerConfig):
        forbid_pickle(config.allow_pickle)
        self.config = config
        missing = token_file_to_create(config.token_file)  # written only once the port is bound
        token = new_token() if missing else resolve_token(token_file=config.token_file)
        self.service = ControllerService(
            token=token,
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            step_timeout_s=config.step_timeout_s,
            lease_timeout_s=config.lease_timeout_s,
            status_grace_s=config.status_grace_s,
            state_dir=config.state_dir,
        )
        self.server, self.port = make_server(token, config.host, config.port)
        if missing:
            create_token_file(missing, token)
        pb_grpc.add_ControllerServicer_to_server(self.service, self.server)
        self.health = Health(self.server, "atoll.v1.Controller")
        """grpc.health.v1: SERVING once started, NOT_SERVING from the moment it begins to stop."""
        self.address = _address.join(config.host, self.port)
        self.metrics_address = ""
        """host:port of the metrics server once started ("" without one)."""

    def start(self) -> None:
        self.server.start()
        self.service.registry.run_health_checks()
        self.service.run_lease_checks()
        if self.config.metrics_port is not None:
            self.metrics_address = self.service.metrics.serve(self.config.host, self.config.metrics_port)
        self.health.set(True)
        log.info("controller listening on %s", self.address)

    def stop(self) -> None:
        self.health.shutdown()
        self.server.stop(grace=1.0).wait(5.0)
        self.service.stop()
