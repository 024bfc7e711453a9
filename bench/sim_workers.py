"""Simulated workers for bench/dispatch.py: one process that registers COUNT workers with a
controller (one gRPC port each) and answers their control calls without running any stage, so
the controller's dispatch cost can be measured at cluster sizes this machine cannot run.

    python bench/sim_workers.py --controller HOST:PORT --token-file F --count 128 --island sim

Every call is answered at once: LoadPlan and Unload do nothing, RunStep replies with an empty
step, and RunStepGroup relays to the other members exactly as a real worker does
(runtime/net/relay.py), which is the part whose cost matters. Heartbeats go at the interval the
controller asks for, one call per simulated worker, as real workers send them.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atoll._rpc import atoll_pb2 as pb  # noqa: E402
from atoll._rpc import atoll_pb2_grpc as pb_grpc  # noqa: E402
from atoll.cli.daemons import serve_until_stopped  # noqa: E402
from atoll.errors import AtollError  # noqa: E402
from atoll.net.auth import resolve_token  # noqa: E402
from atoll.net.relay import Relay  # noqa: E402
from atoll.net.rpc import Endpoint, chunked_method, make_server, rpc_handler, rpc_stream_handler  # noqa: E402
from atoll.worker.channel import StepChannels  # noqa: E402

log = logging.getLogger("atoll.sim")


class SimulatedWorkers(pb_grpc.WorkerServicer):
    def __init__(self, token: str):
        self.relay = Relay(token, self._run_own)
        self.channels = StepChannels(self._run_own)

    @staticmethod
    def _run_own(request: pb.RunStepRequest) -> pb.RunStepReply:
        return pb.RunStepReply(memory_json="{}")

    Chunked = chunked_method("Worker")  # LoadPlan comes in pieces, as to a real worker

    @rpc_handler
    def LoadPlan(self, request, context):
        return pb.LoadPlanReply()

    @rpc_handler
    def RunStep(self, request, context):
        return self._run_own(request)

    @rpc_stream_handler
    def StepChannel(self, requests, context):
        yield from self.channels.serve(requests)

    @rpc_handler
    def RunStepGroup(self, request, context):
        return self.relay.run(request)

    @rpc_handler
    def Unload(self, request, context):
        return pb.Empty()

    @rpc_handler
    def Ping(self, request, context):
        return pb.Empty()


class SimulatedDaemon:
    def __init__(self, controller: str, token: str, count: int, island: str):
        self.service = SimulatedWorkers(token)
        self.server, first = make_server(token, "127.0.0.1", 0, max_workers=256)
        self.ports = [first] + [self.server.add_insecure_port("127.0.0.1:0") for _ in range(count - 1)]
        pb_grpc.add_WorkerServicer_to_server(self.service, self.server)
        self.address = f"127.0.0.1:{first}"
        self.island = island
        self._controller = Endpoint(controller, token, pb_grpc.ControllerStub, default_timeout_s=30.0)
        self._token = token
        self._ids: list[str] = []
        self._interval = 1.0
        self._stop = threading.Event()

    def start(self) -> None:
        self.server.start()
        for port in self.ports:
            reply = self._controller.call(
                "RegisterWorker",
                pb.RegisterWorkerRequest(
                    address=f"127.0.0.1:{port}",
                    device="cpu",
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    island=self.island,
                ),
            )
            self._ids.append(reply.worker_id)
            self.service.relay.use_controller_key(reply.controller_key)
            self._interval = reply.heartbeat_interval_s or 1.0
        # heartbeats carry the key the controller gave at registration, as a real worker's do
        self._beats = Endpoint(self._controller.address, self._token, pb_grpc.ControllerStub, 5.0, reply.controller_key)
        threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()

    def _heartbeats(self) -> None:
        """Each worker's heartbeat once per interval, spread evenly over it (real workers start at
        different times), so the controller's load from them is steady, not a burst."""
        gap = self._interval / len(self._ids)
        while not self._stop.is_set():
            for worker_id in self._ids:
                if self._stop.wait(gap):
                    return
                try:
                    self._beats.call("Heartbeat", pb.HeartbeatRequest(worker_id=worker_id))
                except AtollError as e:
                    log.warning("heartbeat of %s failed: %s", worker_id, e)

    def stop(self) -> None:
        self._stop.set()
        self.server.stop(grace=1.0).wait(5.0)
        self.service.relay.close()
        self._controller.close()
        self._beats.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--controller", required=True, metavar="HOST:PORT")
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--count", type=int, required=True, help="simulated workers in this process")
    parser.add_argument("--island", default="sim", help="island label of every simulated worker")
    parser.add_argument("--ready-file", default=None, help="written once every worker is registered")
    parser.add_argument("--exit-with-parent", type=int, default=None, metavar="PID")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    daemon = SimulatedDaemon(args.controller, resolve_token(token_file=args.token_file), args.count, args.island)
    serve_until_stopped(daemon, args.ready_file, args.exit_with_parent, f"{args.count} simulated workers")


if __name__ == "__main__":
    main()
