"""The project installs one top-level package, `atoll`; nothing imports the folder names."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import atoll

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
OLD_IMPORT = re.compile(r"^\s*(import (runtime|controller)\b|from (runtime|controller)(\.| import))", re.M)


def test_import_atoll_finds_no_runtime_or_controller_module(tmp_path):
    # a fresh interpreter outside the checkout: only what is installed is importable
    code = (
        "import importlib.util as u, atoll\n"
        "assert u.find_spec('runtime') is None and u.find_spec('controller') is None\n"
        "import atoll.controller.service, atoll.cli.commands\n"
        "print(atoll.LocalCluster.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, env={}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "atoll.client.local"
    assert set(atoll.__all__) >= {"LocalCluster", "connect", "InvalidInput", "JobFailed"}


def test_the_wheel_holds_only_the_atoll_package(tmp_path):
    source = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    for name in ("runtime", "controller"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("atoll-*.whl")
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"atoll"}, top
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"atoll/controller/service.py", "atoll/_rpc/atoll_pb2.py", "atoll/worker/transports/nccl.py"}
    # every module of both folders, at its installed name (runtime/ is atoll/, controller/ atoll/controller/)
    expected |= {f"atoll/{p.relative_to(ROOT / 'runtime').as_posix()}" for p in (ROOT / "runtime").rglob("*.py")}
    expected |= {f"atoll/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "controller").rglob("*.py")}
    assert expected <= names, sorted(expected - names)


def test_no_code_or_doc_imports_the_folder_names():
    sources = [
        p for d in ("runtime", "controller", "tests", "examples", "bench", "proto") for p in (ROOT / d).rglob("*.py")
    ]
    sources += [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    offenders = [str(p.relative_to(ROOT)) for p in sources if OLD_IMPORT.search(p.read_text())]
    assert not offenders, f"import atoll instead of runtime/controller in: {offenders}"


def test_documents_the_code_cites_are_in_the_repository():
    sources = [p for d in ("runtime", "controller", "tests", "proto") for p in (ROOT / d).rglob("*.py")]
    sources += [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    cited = {m for p in sources for m in re.findall(r"docs/[\w.-]+\.md", p.read_text())}
    assert cited, "the code cites its design notes"
    assert all((ROOT / c).is_file() for c in cited), sorted(c for c in cited if not (ROOT / c).is_file())
    outside = [p for p in sources if p != Path(__file__).resolve() and "ARCHITECTURE.md" in p.read_text()]
    assert not outside, f"cite docs/architecture.md instead: {outside}"
