"""The update a server applies to one key: SGD or AdamW, on the whole key or on some of its rows.

Written out rather than delegated to torch.optim so that an update can touch only some rows of
a table (the rows a sparse push carries) and keep a step count per row: the "lazy" update of
torch's SparseAdam, where an untouched row's moments and weight stay as they were. On a whole
key the arithmetic is torch.optim.AdamW's (decoupled weight decay, bias correction, eps added
after the square root), so a dense parameter trained here matches a torch.optim run.
"""

from __future__ import annotations

import torch

from atoll.core.ps_rules import UpdateRule


class KeyState:
    """One key's value and its optimizer state (AdamW: moments and a step count per row)."""

    STATE = ("exp_avg", "exp_avg_sq", "steps")

    def __init__(self, value: torch.Tensor, rule: UpdateRule):
        self.value = value
        self.rule = rule
        self.state: dict[str, torch.Tensor] = {}
        if rule.name == "adamw":
            rows = value.shape[0] if value.dim() else 1
            self.state = {
                "exp_avg": torch.zeros_like(value),
                "exp_avg_sq": torch.zeros_like(value),
                "steps": torch.zeros(rows, dtype=torch.int64),
            }

    def apply(self, grad: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """``grad`` of the whole key, or of ``rows`` (unique row numbers inside the key)."""
        if self.rule.name == "sgd":
            self._sgd(grad, rows)
        else:
            self._adamw(grad, rows)

    def _sgd(self, grad, rows) -> None:
        lr, wd = self.rule.lr, self.rule.weight_decay
        if rows is None:
            self.value.add_(grad + wd * self.value if wd else grad, alpha=-lr)
        else:
            part = self.value[rows]
            self.value[rows] = part - lr * (grad + wd * part if wd else grad)

    def _adamw(self, grad, rows) -> None:
        rule = self.rule
        b1, b2 = rule.betas
        v = self.value if self.value.dim() else self.value.view(1)
        g = grad if grad.dim() else grad.view(1)
        m, s, steps = self.state["exp_avg"], self.state["exp_avg_sq"], self.state["steps"]
        m, s = (m if m.dim() else m.view(1)), (s if s.dim() else s.view(1))
        index = slice(None) if rows is None else rows
        p, m_r, s_r = v[index], m[index], s[index]
        steps[index] += 1
        step = steps[index].to(v.dtype).view(-1, *([1] * (v.dim() - 1)))
        p = p * (1 - rule.lr * rule.weight_decay)
        m_r = m_r.lerp(g, 1 - b1)
        s_r = s_r * b2 + (1 - b2) * g * g
        bias1 = 1 - b1**step
        bias2_sqrt = (1 - b2**step).sqrt()
        p = p - (rule.lr / bias1) * m_r / (s_r.sqrt() / bias2_sqrt + rule.eps)
        v[index], m[index], s[index] = p, m_r, s_r
