"""Exported stage graphs: safe loading, and running a stage program on flat tensor lists.

A stage's inputs and outputs are flat lists of tensors (atoll.core.dataflow says which edge fills which
position); an exported program's call spec restores the structure (tensor, tuple, dict) its
forward expects, as for the loss, which takes the model's output and the target.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree
from torch.fx.graph_module import _forward_from_src

from atoll.core import (
    collectives,  # noqa: F401 (registers the island ops that sharded stage graphs call)
    export_serde,
)
from atoll.errors import InvalidInput

log = logging.getLogger("atoll.export")

# torch.export.load falls back to full unpickling when a weights-only load fails; this makes
# torch.load refuse instead. Daemons set it at start unless the operator opts in to pickle.
FORCE_WEIGHTS_ONLY_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def forbid_pickle(allow_pickle: bool = False) -> None:
    if not allow_pickle:
        os.environ[FORCE_WEIGHTS_ONLY_ENV] = "1"


def serialize(ep: torch.export.ExportedProgram) -> bytes:
    export_serde.apply()
    buf = io.BytesIO()
    with _without_checksums():
        torch.export.save(ep, buf)
    return buf.getvalue()


@contextlib.contextmanager
def _without_checksums():
    """Archives without a CRC-32 per record (torch's own option, ``set_crc32_options``). They
    only cross gRPC streams (TCP's checksums, TLS's MACs where on) or sit in a state directory
    that writes and syncs them whole; and under the daemons' malloc settings the checksums were
    most of the cost of a large model's archive: 1.2 GB of weights saved in 2.1-6.9 s with
    them, 1.0-1.1 s without, loaded in 2.1-3.0 s with, 0.22 s without (the loader checks none
    it does not find). A process-wide flag of torch's, set for the save's duration."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


class _ToDebug(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log.debug("%s: %s", record.name, record.getMessage(), exc_info=record.exc_info)


@contextlib.contextmanager
def torch_logs_at_debug():
    """torch's own log lines (a failed export logs each fake-tensor traceback on stderr, ~20
    lines before the one-line error atoll raises) go to atoll's log at DEBUG instead: shown with
    ``--log-level DEBUG``, not printed otherwise."""
    swapped = []
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch") and isinstance(logger, logging.Logger):
            streams = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
            if streams:
                swapped.append((logger, streams))
                for h in streams:
                    logger.removeHandler(h)
                logger.addHandler(_TO_DEBUG)
    try:
        yield
    finally:
        for logger, streams in swapped:
            logger.removeHandler(_TO_DEBUG)
            for h in streams:
                logger.addHandler(h)


_TO_DEBUG = _ToDebug()


def export(module: torch.nn.Module, args: tuple, failure: str, frozen_values: bool = True) -> bytes:
    """``module`` exported at ``args`` and serialized; a failure raises InvalidInput starting
    ``failure`` (the client exporting a model, the compiler a stage or a sharded stage).
    ``frozen_values=False``: the frozen parameters travel as shapes only (``leave_out_values``)."""
    try:
        with warnings.catch_warnings(), torch_logs_at_debug(), _without_stack_traces():
            warnings.simplefilter("ignore")
            ep = torch.export.export(module, args)
            if not frozen_values:
                leave_out_values(ep, [n for n in ep.graph_signature.parameters if not ep.state_dict[n].requires_grad])
            return serialize(ep)
    except Exception as e:
        raise InvalidInput(f"{failure}: {type(e).__name__}: {e}") from None


@contextlib.contextmanager
def _without_stack_traces():
    """Export without recording each node's Python stack: nothing here reads them, and capturing
    them costs about a quarter of an export and 8% of the archive (tests/models.py's GPT). (A
    process-wide flag of torch's, set for the export's duration; torch 2.11 has none and records
    them.)"""
    import torch.fx.config as fx_config

    if not hasattr(fx_config, "do_not_emit_stack_traces"):
        yield
        return
    previous, fx_config.do_not_emit_stack_traces = fx_config.do_not_emit_stack_traces, True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = previous


def leave_out_values(ep: torch.export.ExportedProgram, names) -> None:
    """Keep each named parameter's shape, dtype and requires_grad in ``ep``, not its bytes (a zero
    broadcast to the shape, a few bytes in the archive): for parameters whose values the workers
    hold already (a resident base's) or get elsewhere (a parameter server's)."""
    for name in names:
        value = ep.state_dict[name]
        placeholder = torch.zeros((), dtype=value.dtype).expand(value.shape)
        ep.state_dict[name] = torch.nn.Parameter(placeholder, value.requires_grad)


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``fx.GraphModule(root, graph)``, whose buffers stay out of its ``state_dict`` where they were
    out of ``root``'s (fx copies every buffer it reads as a persistent one)."""
    module = torch.fx.GraphModule(root, graph)
    kept = root.state_dict(keep_vars=True).keys()
    for name, _ in root.named_buffers():
        owner, _, attr = name.rpartition(".")
        if name in kept:
            continue
        try:
            holder = module.get_submodule(owner)
        except AttributeError:  # a buffer the graph does not read
            continue
        if attr in holder._buffers:
            holder._non_persistent_buffers_set.add(attr)
    return module


def deserialize(data: bytes, what: str) -> torch.export.ExportedProgram:
    export_serde.apply()
    try:
        return torch.export.load(io.BytesIO(data))
    except Exception as e:
        raise InvalidInput(
            f"{what}: not a loadable torch.export archive "
            f"(arbitrary pickled objects are refused): {type(e).__name__}: {e}"
        ) from None


def flatten(value) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten(value)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise InvalidInput(f"edges carry tensors only, found {type(leaf).__name__}")
    return leaves


def on_device(ep: torch.export.ExportedProgram, device: str | torch.device, fake_mode=None):
    """``ep`` with its weights and the devices written into its graph moved to ``device``.

    Clients export on CPU, so a graph may name ``cpu`` in its nodes (``torch.arange(...,
    device=x.device)`` is recorded as a constant device); moving only the module's parameters
    would leave those behind. Under ``fake_mode`` the weights become fake tensors first, so the
    controller can analyze a CUDA stage without allocating on (or even having) that device's memory.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return ep
    if device.type == "cuda" and device.index is None:
        # torch.device("cuda") != torch.device("cuda:0"): the device checks export records for
        # ``.to(...)`` (``_assert_tensor_metadata``) compare the moved name with the tensors' own
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    from torch.export.passes import move_to_device_pass

    if fake_mode is not None:
        for key, value in list(ep.state_dict.items()):
            fake = fake_mode.from_tensor(value)
            is_param = isinstance(value, torch.nn.Parameter)
            ep.state_dict[key] = torch.nn.Parameter(fake, requires_grad=value.requires_grad) if is_param else fake
        for key, value in list(ep.constants.items()):
            if isinstance(value, torch.Tensor):
                ep.constants[key] = fake_mode.from_tensor(value)
    return move_to_device_pass(ep, device)


class BlockGraph:
    """One exported program (a stage, or the loss), ready to call."""

    def __init__(self, name: str, ep: torch.export.ExportedProgram):
        self.name = name
        self.ep = ep
        # Inputs are checked once, against the compiled specs (the controller checks batches,
        # receive buffers are allocated from the specs); torch's per-call guards and structure
        # checks would repeat that on every microbatch, at about a tenth of a small stage's time.
        self.module = ep.module(check_guards=False)
        self.module.validate_inputs = False
        self._flat_forward = _flat_forward(self.module)

    def call_flat(self, leaves: Sequence[torch.Tensor]) -> tuple:
        """The program on its flat inputs (the exported program's placeholders, in order): its flat outputs."""
        return self._flat_forward(self.module, *leaves)


def _flat_forward(module: torch.fx.GraphModule):
    """``module``'s forward from its flat inputs to its flat outputs: the exported module's own code
    without the pytree unflatten of the arguments and flatten of the results around it (and
    nn.Module's call machinery), which callers holding flat tensors would undo again; about a
    fifth of a tiny stage's forward. The module's attributes are read at every call, as its own
    forward reads them, so parameters replaced or resized in place are seen."""
    graph = module.graph
    pytree_codegen = graph._codegen
    graph._codegen = torch.fx.graph.CodeGen()  # fx's plain code: placeholders in, output tuple out
    try:
        code = graph.python_code(root_module="self")
    finally:
        graph._codegen = pytree_codegen
    return _forward_from_src(code.src, code.globals)


class StageGraph:
    """One stage's program: flat input tensors -> its outputs, with the model's parameter names."""

    def __init__(self, program: BlockGraph):
        self.program = program

    def forward(self, leaves: Sequence[torch.Tensor]):
        return self.program.call_flat(leaves)

    def named_parameters(self):
        return self.program.module.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.program.module.state_dict()

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers of the model's ``state_dict``: a non-persistent one (a rotary embedding's
        ``inv_freq``) stays inside the program, out of checkpoints as out of ``state_dict``."""
        kept = self.program.module.state_dict(keep_vars=True).keys()
        return [(n, b) for n, b in self.program.module.named_buffers() if n in kept]

    def on(self, device, fake_mode=None) -> StageGraph:
        """This stage rebuilt on ``device`` (see ``on_device``); on CPU, itself."""
        if torch.device(device).type == "cpu":
            return self
        return StageGraph(BlockGraph(self.program.name, on_device(self.program.ep, device, fake_mode)))
