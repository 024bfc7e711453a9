"""An embedded local cluster: a controller and N workers as subprocesses on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from atoll.cli.malloc import daemon_malloc_tunables
from atoll.client.client import Client, connect
from atoll.client.cuda_mps import CudaMps
from atoll.client.cuda_mps import wanted as cuda_mps_wanted
from atoll.client.zygote import ForkedProcess, Zygote, zygote_for
from atoll.errors import WorkerUnavailable
from atoll.net.auth import create_token_file


def daemon_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a LocalCluster's daemons run with: this process's, unbuffered, with the
    daemons' malloc settings (atoll.cli.malloc) and ``extra`` (a CUDA MPS daemon's variables)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["GLIBC_TUNABLES"] = daemon_malloc_tunables(env.get("GLIBC_TUNABLES", ""))
    env.update(extra or {})
    return env


def stop_processes(procs: list[subprocess.Popen | ForkedProcess], timeout_s: float = 10.0) -> None:
    """SIGTERM each, wait up to ``timeout_s`` in all, SIGKILL whatever is left; reaps them all."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


class LocalCluster:
    """Starts a controller and ``workers`` workers with a fresh token; stops them all on exit.

    ``devices`` gives each worker's device ("cpu", "cuda:0", ...); by default all are CPU
    workers. Several workers may share one GPU: their edges then go over CUDA IPC. ``islands``
    gives each worker's island label (by default, all are on this host's island).

    Use as a context manager. Every process is started by this object, tracked by PID, and
    stopped on exit (also when the body raises); each daemon also exits by itself if this
    process dies. On Linux the daemons of a CPU cluster are forked from one zygote process that
    imported torch and atoll once (atoll.cli.zygote), not each started from a fresh interpreter:
    a cluster then pays the imports' seconds of CPU once, not once per daemon. CUDA workers
    cannot be forked so (see ``_forks_daemons``).

    Logs go to ``log_dir``, removed on a clean exit; kept when ``keep_logs``, when the body
    raised (a job failed, say) or when a daemon exited with an error, and then named in one line
    on stderr.

    ``cuda_mps`` starts a private CUDA MPS daemon for the cluster's workers, so workers that
    share a GPU run their kernels side by side instead of taking turns (atoll.client.cuda_mps).
    By default (None) it does so where two or more workers share a GPU, the driver ships MPS and
    no MPS daemon already serves them (atoll.client.cuda_mps.already_running), and goes on
    without it, with a warning, if the daemon does not start; True insists, False never starts
    one. ``mps_running`` says which it came to.

    ``metrics_port`` (0: a free one) has the controller serve Prometheus metrics at
    ``http://{metrics_address}/metrics``. ``state_dir`` has the controller record its workers and
    jobs there (``atoll controller --state-dir``; README "Operations").
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        threads_per_worker: int | None = None,
        startup_timeout_s: float = 90.0,
        heartbeat_timeout_s: float = 5.0,
        heartbeat_interval_s: float = 1.0,
        lease_timeout_s: float = 30.0,
        status_grace_s: float = 60.0,
        tls: tuple[str, str, str] | None = None,
        keep_logs: bool = False,
        log_level: str = "WARNING",
        devices: list[str] | None = None,
        islands: list[str] | None = None,
        metrics_port: int | None = None,
        state_dir: str | os.PathLike | None = None,
        cuda_mps: bool | None = None,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if devices is not None and len(devices) != workers:
            raise ValueError(f"devices names {len(devices)} devices for {workers} workers")
        self.devices = list(devices) if devices is not None else ["cpu"] * workers
        if islands is not None and len(islands) != workers:
            raise ValueError(f"islands names {len(islands)} islands for {workers} workers")
        self.cuda_mps = cuda_mps_wanted(cuda_mps, self.devices)
        self._mps_required = bool(cuda_mps)
        self._mps: CudaMps | None = None
        self.islands = list(islands) if islands is not None else [""] * workers
        self.num_workers = workers
        self.threads_per_worker = threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        self.startup_timeout_s = startup_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lease_timeout_s = lease_timeout_s
        self.status_grace_s = status_grace_s
        self.tls = tls
        """(CA, certificate, key) PEM files: every daemon serves and dials gRPC over TLS, and
        ``client()`` trusts the CA."""
        self.keep_logs = keep_logs
        self.log_level = log_level
        self.metrics_port = metrics_port
        self.state_dir = state_dir
        self.metrics_address = ""
        """host:port of the controller's Prometheus metrics (with ``metrics_port``)."""
        self.address = ""
        self.token = ""
        self.log_dir: Path | None = None
        self.controller: subprocess.Popen | ForkedProcess | None = None
        self.workers: list[subprocess.Popen | ForkedProcess] = []
        self._zygote: Zygote | None = None
        self._owns_zygote = False  # not a shared one (atoll.client.zygote.shared)
        self._logs: list = []
        self._killed: set[int] = set()  # PIDs stopped on purpose (kill_worker): their exit is no error

    @property
    def mps_running(self) -> bool:
        """Whether the workers share their GPUs through this cluster's MPS daemon."""
        return self._mps is not None

    def _start_mps(self) -> CudaMps | None:
        try:
            return CudaMps(self.log_dir / "mps")
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            if self._mps_required:
                raise
            warnings.warn(f"LocalCluster: workers share a GPU without CUDA MPS, which did not start: {e}", stacklevel=3)
            return None

    def _forks_daemons(self) -> bool:
        """Whether the daemons fork from a zygote: on Linux, for CPU workers only. CUDA's state does
        not survive a fork, and torch marks a child forked after its parent touched CUDA (the
        zygote's imports ask for the device count) so that any CUDA call there fails; a cluster
        with CUDA workers starts every daemon, the controller too (it analyzes on fake CUDA
        tensors), from a fresh interpreter."""
        return hasattr(os, "fork") and sys.platform.startswith("linux") and all(d == "cpu" for d in self.devices)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in ([self.controller] if self.controller else []) + self.workers]

    def _env(self) -> dict[str, str]:
        return daemon_env(self._mps.env if self._mps is not None else {})

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen | ForkedProcess:
        log = open(self.log_dir / f"{name}.log", "w")
        self._logs.append(log)
        tls = []
        if self.tls is not None:
            ca, cert, key = self.tls
            tls = ["--tls-ca", str(ca), "--tls-cert", str(cert), "--tls-key", str(key)]
        argv = [
            *args,
            *tls,
            "--exit-with-parent",
            str(os.getpid()),
            "--log-level",
            self.log_level,
        ]
        if self._zygote is not None:
            return self._zygote.spawn(argv, log.name, self._env())
        cmd = [sys.executable, "-m", "atoll.cli", *argv]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env())

    def _wait_file(self, path: Path, proc: subprocess.Popen | ForkedProcess, deadline: float) -> str:
        while time.monotonic() < deadline:
            if path.exists():
                return path.read_text().strip()
            if proc.poll() is not None:
                raise WorkerUnavailable(
                    f"process exited with code {proc.returncode} during startup:\n{self._tail(proc)}"
                )
            time.sleep(0.05)
        raise WorkerUnavailable(f"no ready file {path} within {self.startup_timeout_s}s")

    def _tail(self, proc: subprocess.Popen | ForkedProcess) -> str:
        for log in self._logs:
            log.flush()
        name = "controller" if proc is self.controller else f"worker{self.workers.index(proc)}"
        return (self.log_dir / f"{name}.log").read_text()[-3000:]

    def start(self) -> LocalCluster:
        self.log_dir = Path(tempfile.mkdtemp(prefix="atoll-cluster-"))
        token_file = self.log_dir / "token"
        self.token = create_token_file(token_file)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            if self.cuda_mps:
                self._mps = self._start_mps()
            if self._forks_daemons():
                self._zygote, self._owns_zygote = zygote_for(self._env(), self.log_dir, self.startup_timeout_s)
            ready = self.log_dir / "controller.ready"
            self.controller = self._spawn(
                "controller",
                [
                    "controller",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--token-file",
                    str(token_file),
                    "--ready-file",
                    str(ready),
                    "--heartbeat-timeout",
                    str(self.heartbeat_timeout_s),
                    "--heartbeat-interval",
                    str(self.heartbeat_interval_s),
                    "--lease-timeout",
                    str(self.lease_timeout_s),
                    "--status-grace",
                    str(self.status_grace_s),
                    *([] if self.metrics_port is None else ["--metrics-port", str(self.metrics_port)]),
                    *([] if self.state_dir is None else ["--state-dir", os.fspath(self.state_dir)]),
                ],
            )
            # the ready file: the address, then "metrics HOST:PORT" when the controller serves metrics
            self.address, *rest = self._wait_file(ready, self.controller, deadline).splitlines()
            self.metrics_address = next((line.split()[1] for line in rest if line.startswith("metrics ")), "")
            for i in range(self.num_workers):
                self.workers.append(
                    self._spawn(
                        f"worker{i}",
                        [
                            "worker",
                            "--controller",
                            self.address,
                            "--device",
                            self.devices[i],
                            "--token-file",
                            str(token_file),
                            "--threads",
                            str(self.threads_per_worker),
                            "--ready-file",
                            str(self.log_dir / f"worker{i}.ready"),
                            *(["--island", self.islands[i]] if self.islands[i] else []),
                        ],
                    )
                )
            for i, proc in enumerate(self.workers):
                self._wait_file(self.log_dir / f"worker{i}.ready", proc, deadline)
            self._wait_registered(deadline)
        except BaseException:
            self.stop(failed=True)
            raise
        return self

    def _wait_registered(self, deadline: float) -> None:
        with self.client() as client:
            while True:
                alive = sum(w.alive for w in client.status().workers)
                if alive >= self.num_workers:
                    return
                if time.monotonic() > deadline:
                    raise WorkerUnavailable(f"only {alive} of {self.num_workers} workers registered in time")
                time.sleep(0.05)

    def client(self) -> Client:
        return connect(self.address, self.token, tls_ca=str(self.tls[0]) if self.tls else None)

    def kill_worker(self, index: int) -> int:
        """SIGKILL one worker (to test failure handling); returns its PID."""
        proc = self.workers[index]
        self._killed.add(proc.pid)
        proc.kill()
        proc.wait(10)
        return proc.pid

    def stop(self, failed: bool = False) -> None:
        """Stop every process. The logs are removed unless ``keep_logs``, ``failed`` (the caller
        saw an error) or a daemon exited with an error (not 0, nor -15: killed by SIGTERM before
        its handler was in place); kept logs are named on stderr."""
        procs = [p for p in [*self.workers, self.controller] if p is not None]
        stop_processes(procs)
        if self._zygote is not None and self._owns_zygote:
            self._zygote.close()
        self._zygote = None
        if self._mps is not None:
            self._mps.stop()
            self._mps = None
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self.log_dir is None or self.keep_logs or not self.log_dir.exists():
            return
        names = {id(self.controller): "controller", **{id(w): f"worker{i}" for i, w in enumerate(self.workers)}}
        bad = [
            f"{names[id(p)]} exited with code {p.returncode}"
            for p in procs
            if p.returncode not in (0, -signal.SIGTERM) and p.pid not in self._killed
        ]
        if failed or bad:
            why = "; ".join(bad) or "the cluster's user raised an error"
            print(f"atoll LocalCluster: {why}; its logs are kept in {self.log_dir}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # an error in the body keeps the logs; Ctrl-C, or a generator closed early, is no failure
        self.stop(failed=exc_type is not None and not issubclass(exc_type, (KeyboardInterrupt, GeneratorExit)))
