"""CUDA MPS for workers that share one GPU: their kernels then run side by side.

Without MPS a GPU runs one process's context at a time and switches between them by time
slices, so four pipeline workers on one GPU take turns even where their work could overlap.
The MPS server holds one context for all its clients instead. Measured on a lent H200 (GPT,
8 layers, d_model 512, 4-stage 1F1B over cuda_ipc, `bench/pipeline.py --device cuda`): the
pipeline ran at 0.83x one process on the same GPU without MPS and 1.04x with it; on a lent H100
(2026-11-27, the same benchmark) 0.74x without and 1.06x with it. So ``LocalCluster`` starts one
by default where two or more of its workers share a GPU (``wanted``).

A private control daemon per cluster: its pipe and log folders are given to every daemon the
cluster starts through the environment (CUDA reads them when a process first touches the GPU),
and ``stop`` asks it to quit, which also ends the server it started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where CUDA clients look when $CUDA_MPS_PIPE_DIRECTORY is unset


def shares_a_gpu(devices: list[str]) -> bool:
    """Whether two or more of these devices name the same GPU ("cuda" is "cuda:0")."""
    gpus = [d if ":" in d else f"{d}:0" for d in devices if d.startswith("cuda")]
    return len(set(gpus)) < len(gpus)


def already_running() -> bool:
    """Whether this process's CUDA clients already reach an MPS daemon: one the user pointed to
    ($CUDA_MPS_PIPE_DIRECTORY), or one at the default pipe directory (a system-wide daemon)."""
    if "CUDA_MPS_PIPE_DIRECTORY" in os.environ:
        return True
    return os.path.exists(os.path.join(DEFAULT_PIPE_DIRECTORY, "control"))


def wanted(requested: bool | None, devices: list[str]) -> bool:
    """Whether a cluster of workers on ``devices`` runs them under a private MPS daemon. ``None``
    (the default): where two or more share a GPU, the driver ships MPS's control program and no
    daemon already serves this process's clients (``already_running``); True: always (refused
    without CUDA workers); False: never."""
    if requested is None:
        return shares_a_gpu(devices) and shutil.which(CONTROL) is not None and not already_running()
    if requested and not any(d.startswith("cuda") for d in devices):
        raise ValueError("cuda_mps=True needs CUDA workers: devices names none")
    return requested


class CudaMps:
    def __init__(self, folder: Path, timeout_s: float = 10.0):
        binary = shutil.which(CONTROL)
        if binary is None:
            raise RuntimeError(f"cuda_mps: {CONTROL} is not on PATH (it ships with the NVIDIA driver)")
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(folder / "log"),
        }
        for path in self.env.values():
            os.makedirs(path, exist_ok=True)
        self._binary, self._timeout_s = binary, timeout_s
        started = self._control(["-d"])
        if started.returncode != 0:
            raise RuntimeError(f"cuda_mps: {CONTROL} -d failed ({started.returncode}): {started.stdout.strip()}")

    def _control(self, args: list[str], command: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(
            [self._binary, *args],
            input=command,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=self._timeout_s,
        )

    def stop(self) -> None:
        """Quit the control daemon (and its server); call after every client process exited."""
        try:
            self._control([], "quit\n")
        except (OSError, subprocess.SubprocessError):
            pass
