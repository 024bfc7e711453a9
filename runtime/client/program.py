"""MPMD programs: a DAG of different modules, each a stage placed on its own island.

A ``Program`` records stages and the values between them; ``Client.compile`` turns it into one
module whose forward runs the stages in the order they were added, exports it once, and has the
controller split it where each stage's module starts (and inside a stage that is itself a
pipeline of ``stages`` workers), each worker taken from its stage's island. Fan-out (a value
read by several stages) and fan-in (a stage reading several) become edges of the dataflow
graph; stages that do not depend on each other run at the same time on their workers.
``Client.pipeline`` is the program of one stage.

    prog = atoll.Program()
    x, y = prog.input("x", example_x), prog.input("y", example_y)
    a = prog.stage(tower_a, x, island="a")
    b = prog.stage(tower_b, x, island="b")       # fan-out: x goes to both
    out = prog.stage(head, a, b, island="c")     # fan-in
    prog.loss(loss_fn, out, y)
    job = client.compile(prog, microbatches=4, schedule="1f1b", optimizer="adamw")
    job.step(x_batch, y_batch)                   # inputs in the order declared, the target last
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from atoll.client.export import split_names
from atoll.core.graphs import torch_logs_at_debug
from atoll.errors import InvalidInput


@dataclass(frozen=True, eq=False)
class Value:
    """A value of a program: an input, a stage's output, or one item of a stage's tuple output."""

    program: Program
    source: str
    """"input", "stage" or "item"."""
    ref: object

    def __getitem__(self, index: int) -> Value:
        return Value(self.program, "item", (self, index))


@dataclass(frozen=True)
class _Stage:
    name: str
    module: nn.Module
    args: tuple[Value, ...]
    islands: tuple[str, ...]
    """One per worker of the stage (a pipeline of len(islands) workers)."""
    split_at: tuple[str, ...]
    """Names (inside ``module``) of the modules where its second, third, ... worker's part starts."""


class Program:
    def __init__(self):
        self._inputs: list[tuple[str, torch.Tensor]] = []
        self._stages: list[_Stage] = []
        self._loss: tuple[object, Value, Value] | None = None

    def input(self, name: str, example) -> Value:
        """A per-step input (one full batch as ``example``); the loss's target is declared here too.
        ``example`` is a tensor, or a tuple of tensors handed to the stage as one argument (only
        in a program of one stage)."""
        leaves = example if isinstance(example, (tuple, list)) else (example,)
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            raise InvalidInput(f"input {name!r}: the example must be a tensor, got {type(example).__name__}")
        if name in (n for n, _ in self._inputs):
            raise InvalidInput(f"input {name!r} is declared twice")
        self._inputs.append((name, example))
        return Value(self, "input", name)

    def stage(
        self,
        module: nn.Module,
        *args: Value,
        island: str | Sequence[str] = "",
        name: str = "",
        stages: int = 1,
        split_points: Sequence[str | int] | None = None,
    ) -> Value:
        """Run ``module(*args)`` as its own stage, on a worker of ``island`` ("" for any); or, with
        ``stages`` > 1, as a pipeline over that many workers, cut where the modules named in
        ``split_points`` start (names inside ``module``, or indices of its top-level children; a
        program of one stage may leave them out: balanced by cost). ``island`` may also give one
        island per worker of the stage."""
        if not isinstance(module, nn.Module):
            raise InvalidInput(f"a stage runs an nn.Module, got {type(module).__name__}")
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise InvalidInput(f"stages must be a positive integer, got {stages!r}")
        islands = (island,) * stages if isinstance(island, str) else tuple(island)
        if len(islands) != stages:
            raise InvalidInput(f"islands names {len(islands)} islands for a stage of {stages} workers")
        name = name or f"s{len(self._stages)}"
        if not name.isidentifier() or name in (s.name for s in self._stages) or name in dict(self._inputs):
            raise InvalidInput(f"stage name {name!r} must be a new Python identifier")
        for i, a in enumerate(args):
            self._own(a, f"stage {name!r}: argument {i}")
        self._stages.append(_Stage(name, module, args, islands, tuple(split_names(module, split_points))))
        return Value(self, "stage", name)

    def loss(self, loss_fn, output: Value, target: Value) -> None:
        """The scalar to minimize: ``loss_fn(output, target)``; ``target`` is one of the inputs."""
        self._own(output, "the loss's output")
        self._own(target, "the loss's target")
        if output.source == "input" or target.source != "input":
            raise InvalidInput("the loss takes a stage's output and an input (the target)")
        self._loss = (loss_fn, output, target)

    def _own(self, value, what: str) -> None:
        if not isinstance(value, Value):
            raise InvalidInput(f"{what} must be a value of this program, got {type(value).__name__}")
        if value.program is not self:
            raise InvalidInput(f"{what} is a value of another program")

    @staticmethod
    def _root(value: Value) -> Value:
        """The input or stage output an item of a tuple comes from."""
        while value.source == "item":
            value = value.ref[0]
        return value

    def _check_graph(self) -> None:
        """Every value a stage or the loss reads is an input or an earlier stage's output, no stage
        reads the target, and every stage's output is read: one rule wherever the stage stands."""
        order = {s.name: i for i, s in enumerate(self._stages)}
        target = self._loss[2].ref
        reads = {s.name: [self._root(a) for a in s.args] for s in self._stages}
        for stage, values in reads.items():
            for v in values:
                if v.source == "input" and v.ref == target:
                    raise InvalidInput(f"stage {stage!r} reads {target!r}, the loss's target: only the loss may")
                if v.source == "input" and v.ref not in dict(self._inputs):
                    raise InvalidInput(f"stage {stage!r} reads {v.ref!r}, which is no input of this program")
                if v.source == "stage" and v.ref not in order:
                    raise InvalidInput(f"stage {stage!r} reads {v.ref!r}, which is no stage of this program")
        cycle = _cycle({stage: [v.ref for v in values if v.source == "stage"] for stage, values in reads.items()})
        if cycle:
            raise InvalidInput(f"the program has a cycle: {' -> '.join(cycle)} (a program is a DAG)")
        for stage, values in reads.items():
            later = [v.ref for v in values if v.source == "stage" and order[v.ref] >= order[stage]]
            if later:
                raise InvalidInput(f"stage {stage!r} reads {later[0]!r}, added after it: add stages in their order")
        read = {v.ref for values in reads.values() for v in values if v.source == "stage"}
        read.add(self._root(self._loss[1]).ref)
        for s in self._stages:
            if s.name not in read:
                raise InvalidInput(f"stage {s.name!r}: nothing reads its output (pass it to a later stage or the loss)")

    # ------------------------------------------------------------------ what the client submits

    def _checked(self) -> tuple[object, Value, Value]:
        if not self._stages:
            raise InvalidInput("the program has no stage")
        if self._loss is None:
            raise InvalidInput("the program has no loss (call Program.loss)")
        self._check_graph()
        return self._loss

    @property
    def target_name(self) -> str:
        return self._checked()[2].ref

    @property
    def input_names(self) -> list[str]:
        """The inputs the stages read, in the order declared (the target excluded)."""
        return [n for n, _ in self._inputs if n != self.target_name]

    @property
    def islands(self) -> list[str]:
        """Per worker (pipeline rank), in stage order."""
        return [i for s in self._stages for i in s.islands]

    @property
    def ranks(self) -> int:
        return len(self.islands)

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self._stages]

    @property
    def default_name(self) -> str:
        return type(self._stages[0].module).__name__ if len(self._stages) == 1 else "Program"

    def example_batch(self) -> tuple[object, torch.Tensor]:
        """(input, target) as ``Job.step`` takes them: one tensor, or a tuple in the declared order."""
        examples = dict(self._inputs)
        inputs = tuple(examples[n] for n in self.input_names)
        return (inputs[0] if len(inputs) == 1 else inputs), examples[self.target_name]

    @property
    def loss_fn(self):
        return self._checked()[0]

    def _is_one_module(self) -> bool:
        """A program of one stage that reads its one input and whose output the loss takes is that
        stage's module itself (its names unchanged: a pipeline's state_dict). A module of several
        arguments is called by the program's module, which takes the inputs as one tuple."""
        _, output, _ = self._checked()
        (stage,) = self._stages if len(self._stages) == 1 else (None,)
        return (
            stage is not None
            and output.source == "stage"
            and len(stage.args) == 1
            and [a.ref if a.source == "input" else None for a in stage.args] == self.input_names
        )

    def split_at(self, virtual_stages: int = 1) -> list[str]:
        """Names of the modules where pipeline stages 1, 2, ... start (empty: balanced by cost)."""
        if self._is_one_module():
            return list(self._stages[0].split_at)
        if len(self._stages) == 1 and not self._stages[0].split_at:
            return []  # one stage over several workers, balanced by cost
        if virtual_stages != 1 and len(self._stages) > 1:
            raise InvalidInput("interleaved schedules (virtual_stages > 1) take a program of one stage")
        names = []
        for i, s in enumerate(self._stages):
            inner = len(s.islands) * virtual_stages - 1
            if len(s.split_at) != inner:
                raise InvalidInput(
                    f"stage {s.name!r} runs on {len(s.islands)} workers: give its {inner} split_points "
                    f"(got {len(s.split_at)})"
                )
            names += ([f"stages.{s.name}"] if i else []) + [f"stages.{s.name}.{p}" for p in s.split_at]
        return names

    def check_stages(self, microbatches: int) -> None:
        """Run the stages one by one, in order, on fake tensors of one microbatch's shapes: the first
        that fails raises InvalidInput naming it, its module, each value it reads with its spec,
        and what its first layer expects. (Called when exporting a program of several stages
        failed: torch's own error names neither the stage nor the edge.)"""
        from torch._subclasses.fake_tensor import FakeTensorMode

        self._checked()
        examples = dict(self._inputs)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad(), torch_logs_at_debug():
            env = {}
            for n in self.input_names:
                t = examples[n]
                env[n] = mode.from_tensor(t[: max(1, t.shape[0] // microbatches)]) if t.dim() else mode.from_tensor(t)
            for s in self._stages:
                args = [_resolve(a, env) for a in s.args]
                state = {k: mode.from_tensor(v) for k, v in [*s.module.named_parameters(), *s.module.named_buffers()]}
                try:
                    env[s.name] = torch.func.functional_call(s.module, state, tuple(args))
                except Exception as e:  # noqa: BLE001 (reported with the stage's name)
                    reads = "; ".join(f"{_describe(a)}, {_spec(v)}" for a, v in zip(s.args, args))
                    expects = _expects(s.module)
                    raise InvalidInput(
                        f"stage {s.name!r} ({type(s.module).__name__}) fails on what it reads: {reads}"
                        + (f"; its first layer {expects}" if expects else "")
                        + f". torch: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    ) from None

    def module(self) -> nn.Module:
        """The whole program as one module (what is exported, and a single-process reference)."""
        _, output, _ = self._checked()
        if self._is_one_module():
            return self._stages[0].module
        if any(isinstance(e, (tuple, list)) for _, e in self._inputs):
            raise InvalidInput("a program of several stages takes tensor inputs, not tuples")
        return _ProgramModule(self._stages, self.input_names, output)


class _ProgramModule(nn.Module):
    def __init__(self, stages: list[_Stage], input_names: list[str], output: Value):
        super().__init__()
        self.stages = nn.ModuleDict({s.name: s.module for s in stages})
        self._plan = [(s.name, s.args) for s in stages]
        self._input_names = input_names
        self._output = output

    def forward(self, inputs):
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        env = dict(zip(self._input_names, inputs))
        for name, args in self._plan:
            env[name] = self.stages[name](*(_resolve(a, env) for a in args))
        return _resolve(self._output, env)


def _describe(value: Value) -> str:
    if value.source == "item":
        return f"{_describe(value.ref[0])}[{value.ref[1]}]"
    return f"input {value.ref!r}" if value.source == "input" else f"the output of stage {value.ref!r}"


def _spec(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(map(_spec, value)) + ")"
    return type(value).__name__


def _expects(module: nn.Module) -> str | None:
    """What the first layer of ``module`` that declares its input takes, in words (None: none does)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            return f"{type(m).__name__}(in_features={m.in_features}) takes a floating tensor [..., {m.in_features}]"
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            return f"{type(m).__name__}({m.num_embeddings}, {m.embedding_dim}) takes integer indices"
        if isinstance(m, nn.modules.conv._ConvNd):
            return f"{type(m).__name__}(in_channels={m.in_channels}) takes [N, {m.in_channels}, ...]"
        if isinstance(m, nn.LayerNorm):
            shape = ", ".join(map(str, m.normalized_shape))
            return f"LayerNorm({shape}) takes [..., {shape}]"
    return None


def _cycle(reads: dict[str, list[str]]) -> list[str]:
    """A cycle of the graph ``stage -> stages it reads``, as [a, b, ..., a]; [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in reads.get(node, []):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt][::-1]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in reads:
        if node not in state and (found := visit(node)):
            return found
    return []


def _resolve(value: Value, env: dict):
    if value.source == "item":
        inner, index = value.ref
        return _resolve(inner, env)[index]
    if value.ref not in env:
        raise InvalidInput(f"value {value.ref!r} is the target, which no stage may read")
    return env[value.ref]
