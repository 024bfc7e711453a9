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

from atoll._export import split_names
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
        for a in args:
            if not isinstance(a, Value) or a.program is not self:
                raise InvalidInput("a stage's arguments must be values of the same program")
        name = name or f"s{len(self._stages)}"
        if not name.isidentifier() or name in (s.name for s in self._stages):
            raise InvalidInput(f"stage name {name!r} must be a new Python identifier")
        self._stages.append(_Stage(name, module, args, islands, tuple(split_names(module, split_points))))
        return Value(self, "stage", name)

    def loss(self, loss_fn, output: Value, target: Value) -> None:
        """The scalar to minimize: ``loss_fn(output, target)``; ``target`` is one of the inputs."""
        if output.source == "input" or target.source != "input":
            raise InvalidInput("the loss takes a stage's output and an input (the target)")
        self._loss = (loss_fn, output, target)

    # ------------------------------------------------------------------ what the client submits

    def _checked(self) -> tuple[object, Value, Value]:
        if not self._stages:
            raise InvalidInput("the program has no stage")
        if self._loss is None:
            raise InvalidInput("the program has no loss (call Program.loss)")
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
        """A program of one stage that reads the inputs in order and whose output the loss
        takes is that stage's module itself (its names unchanged: a pipeline's state_dict)."""
        _, output, _ = self._checked()
        (stage,) = self._stages if len(self._stages) == 1 else (None,)
        return (
            stage is not None
            and output.source == "stage"
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


def _resolve(value: Value, env: dict):
    if value.source == "item":
        inner, index = value.ref
        return _resolve(inner, env)[index]
    if value.ref not in env:
        raise InvalidInput(f"value {value.ref!r} is the target, which no stage may read")
    return env[value.ref]
