"""A parameter-server job's rules: the update its servers apply and the consistency its pulls
keep (runtime/worker/ps/ applies them; the client checks them before it exports anything)."""

from __future__ import annotations

from dataclasses import dataclass

from atoll.errors import InvalidInput

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True, slots=True)
class UpdateRule:
    name: str
    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise InvalidInput(f"optimizer {self.name!r}: a parameter server applies one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise InvalidInput(f"lr must be positive, got {self.lr}")


CONSISTENCIES = ("sequential", "bounded", "eventual")


@dataclass(frozen=True, slots=True)
class Consistency:
    mode: str
    max_delay: int = 0
    wait_timeout_s: float = 60.0

    def __post_init__(self):
        if self.mode not in CONSISTENCIES:
            raise InvalidInput(f"consistency {self.mode!r}: one of {', '.join(CONSISTENCIES)}")
        if self.max_delay < 0:
            raise InvalidInput(f"max_delay must be at least 0, got {self.max_delay}")
        if not self.wait_timeout_s > 0:
            raise InvalidInput(f"wait_timeout_s must be positive, got {self.wait_timeout_s}")

    def lag(self) -> int | None:
        """How far behind ``t`` the slowest task may be when a pull at ``t`` is served (None: any)."""
        return {"sequential": 0, "bounded": self.max_delay, "eventual": None}[self.mode]
