"""scripts/gpu_deps.py decides which carried wheels a GPU machine installs (scripts/gpu_check.sh).

Its rule: a carried wheel goes in where its package is absent here, or where the version here fails
a requirement on it, the project's or another carried wheel's; otherwise the machine's own copy
stays, since a carried copy first on PYTHONPATH would shadow the one the image's CuPy and torch
use. These run the script on real wheel files against this Python's installed packages.
"""

import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def _deps(*args: str | Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_deps.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _chosen(*folders: Path) -> set[str]:
    return {Path(line).name for line in _deps("wheels", *folders).stdout.split()}


def test_a_package_absent_here_is_installed(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w", "tw_not_installed_anywhere", "1.0")
    assert _chosen(tmp_path / "w") == {wheel.name}


def test_a_package_here_at_a_fitting_version_stays(tmp_path: Path) -> None:
    """The carried packaging 1.0 is older than this machine's, and nothing asks for more."""
    _wheel(tmp_path / "w", "packaging", "1.0")
    proc = _deps("wheels", tmp_path / "w")
    assert proc.stdout.split() == []
    assert f"keeping this machine's packaging {metadata.version('packaging')}" in proc.stderr


def test_another_carried_wheels_requirement_brings_its_package_in(tmp_path: Path) -> None:
    old = _wheel(tmp_path / "a", "packaging", "1.0")
    needs = _wheel(tmp_path / "b", "tw_needs_a_new_packaging", "1.0", ("packaging>=9999",))
    assert _chosen(tmp_path / "a", tmp_path / "b") == {old.name, needs.name}


def test_a_requirement_behind_an_extra_does_not_count(tmp_path: Path) -> None:
    _wheel(tmp_path / "a", "packaging", "1.0")
    needs = _wheel(tmp_path / "b", "tw_extra_only", "1.0", ('packaging>=9999; extra == "docs"',))
    assert _chosen(tmp_path / "a", tmp_path / "b") == {needs.name}


def test_this_test_environment_misses_nothing() -> None:
    """The test command installs the dev extra, so nothing the GPU check needs is missing here."""
    assert _deps("missing").stdout.strip() == ""


def test_without_a_verb_it_prints_its_usage() -> None:
    proc = subprocess.run([sys.executable, "scripts/gpu_deps.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "gpu_deps.py wheels DIR" in proc.stderr


def test_what_the_gpu_machine_brings_is_never_asked_for() -> None:
    """Its torch, CuPy and CuPy's NVRTC are built for its CUDA; the dev extra's CPU-CI copies stay out."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_deps
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    names = {gpu_deps.norm(r.name) for r in gpu_deps.project_requirements()}
    assert names.isdisjoint({"torch", "cupy-cuda12x", "cupy-cuda13x", "nvidia-cuda-nvrtc-cu12", "ucxx-cu12"})
    assert {"grpcio", "protobuf", "pytest"} <= names
