"""Every benchmark runs at its smallest size, so a change that breaks one fails here (the figures
themselves are not asserted: performance lives in the benchmarks' JSON)."""

import pytest

from bench import cli as cli_bench

pytestmark = pytest.mark.cluster  # runs commands in processes of their own


def test_cli_benchmark_runs(capsys):
    result = cli_bench.main(["--repeat", "1"])
    assert set(result) >= {"atoll_status_s", "atoll_status_help_s", "import_atoll_s"}
    assert all(v > 0 for k, v in result.items() if k.endswith("_s"))
