"""The worker daemon: owns one device, keeps itself registered with the controller (heartbeats),
serves the Worker service (atoll.worker.service) and leaves the controller when stopped.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.core.graphs import forbid_pickle
from atoll.errors import AtollError, DeadlineExceeded, InvalidInput, Unauthenticated, WorkerUnavailable
from atoll.net import address as _address
from atoll.net import log as _log
from atoll.net.rpc import Endpoint, Health, make_server
from atoll.worker.ps.service import ParameterServerService
from atoll.worker.service import WorkerService

log = logging.getLogger("atoll.worker.daemon")


def check_device(device: str) -> None:
    """Refuse (InvalidInput) a device this process cannot use, before anything is started."""
    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidInput(f"device {device!r} is not a torch device ({e})") from None
    if kind.type == "cpu":
        return
    if kind.type != "cuda":
        raise InvalidInput(f"device {device!r}: a worker runs on cpu or cuda:N")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise InvalidInput(f"device {device}: {why} (torch {torch.__version__})")
    if kind.index is not None and kind.index >= torch.cuda.device_count():
        raise InvalidInput(f"device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def rss_bytes() -> int:
    """This process's resident memory (sent with each heartbeat)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak instead (KiB on Linux, bytes on macOS)
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class WorkerDaemon:
    """Serves the Worker service and keeps itself registered with the controller."""

    def __init__(
        self,
        *,
        controller: str,
        token: str,
        device: str = "cpu",
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        island: str = "",
        allow_pickle: bool = False,
        register_timeout_s: float = 30.0,
    ):
        check_device(device)
        self.register_timeout_s = register_timeout_s
        """How long ``start`` keeps trying while no controller answers."""
        forbid_pickle(allow_pickle)
        self.controller_address = _address.checked(controller, "controller address")
        self.service = WorkerService(device=device, host=advertise_host or host, token=token, bind_host=host)
        self.server, self.port = make_server(token, host, port)
        pb_grpc.add_WorkerServicer_to_server(self.service, self.server)
        self.parameter_servers = ParameterServerService(self.service, token)
        pb_grpc.add_ParameterServerServicer_to_server(self.parameter_servers, self.server)
        self.health = Health(self.server, "atoll.v1.Worker")
        """grpc.health.v1: SERVING while registered and its heartbeats reach the controller."""
        self._token = token
        self.address = _address.join(advertise_host or host, self.port)
        self.device = device
        self.island = island
        self._controller = Endpoint(controller, token, pb_grpc.ControllerStub, default_timeout_s=10.0)
        self.service.controller = self._controller
        self._stop = threading.Event()
        self.worker_id = ""
        self._keyed: Endpoint | None = None
        """Calls that carry the key of the controller this worker registered with: heartbeats (a
        restarted controller, or another one on the address, answers "unknown") and leaving."""
        self._interval = 1.0

    def _register(self) -> None:
        gpu_uuid = ""
        if self.device.startswith("cuda"):
            gpu_uuid = str(torch.cuda.get_device_properties(torch.device(self.device)).uuid)
        # the controller numbers a registration's work from 1, and may send some as soon as it answers
        self.service.reset_order()
        reply = self._controller.call(
            "RegisterWorker",
            pb.RegisterWorkerRequest(
                address=self.address,
                device=self.device,
                host=socket.gethostname(),
                pid=os.getpid(),
                gpu_uuid=gpu_uuid,
                island=self.island,
                value_address=self.service.values.address,
                worker_id=self.worker_id,  # registering again: the same id, unless another worker has it
                held_jobs=self._held_jobs(),
            ),
        )
        if self.worker_id:  # registering again: the controller restarted or declared us dead
            kept = set(reply.keep_jobs)  # a restarted controller with its state takes its jobs back
            dropped = sorted({h.job_id for h in self._held_jobs()} - kept)
            log.warning(
                "registered again as %s (was %s); keeping jobs [%s], dropping [%s]",
                reply.worker_id,
                self.worker_id,
                ", ".join(sorted(kept)),
                ", ".join(dropped),
            )
            self.service.keep_only(kept)
            self.parameter_servers.keep_only(kept)
        self.worker_id = reply.worker_id
        self.service.controller_key = reply.controller_key
        if self._keyed is not None:
            self._keyed.close()
        self._keyed = Endpoint(
            self.controller_address,
            self._token,
            pb_grpc.ControllerStub,
            default_timeout_s=5.0,
            controller_key=reply.controller_key,
        )
        self.service.relay.use_controller_key(reply.controller_key)
        self._interval = reply.heartbeat_interval_s or 1.0
        _log.set_worker(self.worker_id)
        self.health.set(True)
        log.info("registered as %s at %s", self.worker_id, self.address)
        # at once, not after an interval: a restarted controller sends a job it takes back nothing
        # before this worker's first heartbeat with the new key (it holds that key by now)
        try:
            self._keyed.call("Heartbeat", self._beat())
        except AtollError as e:
            log.warning("first heartbeat to %s failed: %s", self.controller_address, e)

    def _held_jobs(self) -> list[pb.HeldJob]:
        return [*self.service.held_jobs(), *self.parameter_servers.held_jobs()]

    def _beat(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(
            worker_id=self.worker_id, rss_bytes=rss_bytes(), running_steps=self.service.running_steps
        )

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if not self.worker_id:
                    self._register()
                    continue
                beat = self._beat()
                reply = self._keyed.call("Heartbeat", beat)
                if not reply.known:
                    log.warning("controller does not know %s; registering again", self.worker_id)
                    self.health.set(False)
                    self._register()
                self.health.set(True)
            except AtollError as e:
                self.health.set(False)
                log.warning("heartbeat to %s failed: %s", self.controller_address, e)

    # How often a worker waiting for its controller says so (it retries every RETRY_S meanwhile).
    RETRY_S, WARN_EVERY_S = 0.5, 5.0

    def start(self) -> None:
        """Register with the controller, retrying for ``register_timeout_s`` while none answers (it
        may be starting too). An answer that will not change (a wrong token, a refused
        registration) ends the wait at once."""
        register_timeout_s = self.register_timeout_s
        self.server.start()
        started = time.monotonic()
        warned = -self.WARN_EVERY_S
        while True:
            try:
                self._register()
                break
            except Unauthenticated as e:
                raise Unauthenticated(
                    f"the controller at {self.controller_address} refused this worker's token "
                    f"(--token-file, $ATOLL_TOKEN): {e}"
                ) from None
            except (WorkerUnavailable, DeadlineExceeded) as e:
                waited = time.monotonic() - started
                if waited > register_timeout_s:
                    raise WorkerUnavailable(
                        f"no controller answered at {self.controller_address} in {register_timeout_s:g} s "
                        f"(is it running, and is the address right?): {e}"
                    ) from None
                if waited - warned >= self.WARN_EVERY_S:
                    warned = waited
                    log.warning(
                        "no controller answers at %s yet; retrying for up to %g s",
                        self.controller_address,
                        register_timeout_s,
                    )
                time.sleep(self.RETRY_S)
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()

    def _deregister(self, timeout_s: float = 2.0) -> None:
        """Leave the controller at once (not after its heartbeat timeout); its call carries the
        key the controller gave at registration, which only its workers hold."""
        if not self.worker_id or self._keyed is None:
            return
        try:
            self._keyed.call("DeregisterWorker", pb.WorkerRef(worker_id=self.worker_id), timeout_s=timeout_s)
            log.info("deregistered %s", self.worker_id)
        except AtollError as e:  # the controller may be gone or stopping too
            log.info("could not deregister %s: %s", self.worker_id, e)

    def stop(self) -> None:
        self._stop.set()
        self.health.shutdown()
        self._deregister()
        self.server.stop(grace=1.0).wait(5.0)
        self.service.values.close()
        self.service.relay.close()
        self._controller.close()
        if self._keyed is not None:
            self._keyed.close()
