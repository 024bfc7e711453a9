"""Split an ordered sequence of pieces (a model's segments) into contiguous stages of balanced cost."""

from __future__ import annotations

from collections.abc import Sequence

from atoll.errors import InvalidInput


def balanced_partition(costs: Sequence[float], parts: int) -> list[range]:
    """Contiguous split minimizing the most expensive part (exact dynamic program, O(parts * n^2)).

    Ties go to the split whose parts come earliest, which keeps the result deterministic.
    """
    n = len(costs)
    if parts > n:
        raise InvalidInput(
            f"cannot split {n} pieces into {parts} stages: each stage needs one "
            f"(the model has too few places to cut; give fewer stages)"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: least max-part cost of splitting the first i pieces into k parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        bounds.append(range(j, i))
        i = j
    return bounds[::-1]
