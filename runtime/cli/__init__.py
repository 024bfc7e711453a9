"""The ``atoll`` command: daemons, status, plans and traces. It alone composes every side."""

from atoll.cli.commands import main

__all__ = ["main"]
