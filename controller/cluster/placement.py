"""Placement: which live workers a job's ranks run on (docs/architecture.md, "Islands, admission
and sharing")."""

from __future__ import annotations

from atoll.controller.cluster.registry import WorkerRecord
from atoll.errors import NotEnoughWorkers


def place(
    live: list[WorkerRecord],
    held: set[str],
    ranks: int,
    device: str,
    islands: tuple[str, ...] = (),
    exclusive: bool = False,
) -> list[WorkerRecord]:
    """``ranks`` live workers of the job's device kind, least loaded first; rank r on island
    ``islands[r]`` where one is named; for an exclusive job only idle workers, and never a worker
    an exclusive job (``held``: their ids) uses. All or nothing: a request that cannot be met whole
    raises NotEnoughWorkers, naming what was asked and what exists."""
    usable = [
        w for w in live if w.device.split(":")[0] == device and not (w.jobs & held) and not (exclusive and w.jobs)
    ]
    # least-loaded first; registration order breaks ties so placement is repeatable
    usable.sort(key=lambda w: (len(w.jobs), int(w.worker_id[1:])))
    wanted = list(islands) + [""] * (ranks - len(islands))
    chosen: dict[int, WorkerRecord] = {}
    taken: set[str] = set()  # by id: a record's generated == compares every field (1,024 ranks: minutes)
    # ranks bound to an island first, so an unbound rank does not take a bound rank's worker
    for r in sorted(range(ranks), key=lambda r: wanted[r] == ""):
        pick = next((w for w in usable if w.worker_id not in taken and wanted[r] in ("", w.island)), None)
        if pick is None:
            raise NotEnoughWorkers(_shortfall(ranks, device, wanted, live, usable, exclusive))
        chosen[r] = pick
        taken.add(pick.worker_id)
    return [chosen[r] for r in range(ranks)]


def _shortfall(ranks, device, wanted, live, usable, exclusive) -> str:
    of_kind = [w for w in live if w.device.split(":")[0] == device]
    if len(usable) < len(of_kind):
        kind = "idle " if exclusive else ""
        return (
            f"the program needs {ranks} {kind}workers of device kind '{device}' but {len(usable)} are free "
            f"(the others are held by {'jobs' if exclusive else 'exclusive jobs'}; islands: "
            f"{', '.join(sorted({w.island for w in usable})) or 'none'})"
        )
    if any(wanted):
        asked = {i: wanted.count(i) for i in dict.fromkeys(wanted)}
        have: dict[str, int] = {}
        for w in sorted(usable, key=lambda w: w.island):
            have[w.island] = have.get(w.island, 0) + 1
        shown = lambda d: ", ".join(f"{n} on {i or 'any island'}" for i, n in d.items()) or "none"  # noqa: E731
        return (
            f"the program needs {ranks} workers of device kind '{device}' ({shown(asked)}) "
            f"but the live ones are: {shown(have)}"
        )
    names = ", ".join(w.worker_id for w in usable) or "none"
    others = sorted({w.device for w in live} - {w.device for w in usable})
    elsewhere = f"; other live workers have {', '.join(others)}" if others else ""
    return (
        f"the program needs {ranks} workers of device kind '{device}' (one per pipeline rank) "
        f"but {len(usable)} are alive ({names}){elsewhere}"
    )
