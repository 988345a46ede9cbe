"""What scripts/gpu_check.sh must install on a GPU machine, and from which carried wheels.

    python scripts/gpu_deps.py missing          the project's test requirements absent or too old here
    python scripts/gpu_deps.py wheels DIR...    the carried wheels in DIRs to install (paths)

One rule for every carried wheel: it is installed when its package is absent here, or when the
version here fails a requirement on it, the project's or another carried wheel's. A package the
machine has at a fitting version stays: a carried copy first on PYTHONPATH would shadow the one
the image's own CuPy and torch use (cuda-bindings, cuda-core, typing-extensions, ...).
Run from the repository root (pyproject.toml); needs nothing beyond pip.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib
import zipfile
from email.parser import Parser
from importlib import metadata

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # no packaging on the machine: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    from pip._vendor.packaging.version import Version  # type: ignore[assignment]

# tools, not imported by the tests; ucxx comes in its own folders (scripts/gpu_wheels.sh) and is
# optional: its tests skip with a reason without it; torch and CuPy come with the GPU machine,
# built for its CUDA: never install others over them (the dev extra's cupy-cuda12x is for CPU CI,
# and so is its NVRTC: the machine's CuPy brings its own for CUDA 13)
SKIP = {
    "ruff",
    "mypy",
    "grpcio-tools",
    "ucxx-cu12",
    "ucxx-cu13",
    "torch",
    "cupy-cuda12x",
    "cupy-cuda13x",
    "nvidia-cuda-nvrtc-cu12",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def here(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def project_requirements() -> list[Requirement]:
    project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project.get("optional-dependencies", {}).get("dev", [])]
    reqs = [r for r in reqs if norm(r.name) not in SKIP and (r.marker is None or r.marker.evaluate())]
    reqs.append(Requirement("pytest>=8.4"))  # the carried pytest-asyncio 1.x needs it
    return reqs


def wheel_requirements(wheel: pathlib.Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def unmet(req: Requirement) -> bool:
    version = here(req.name)
    return version is None or version not in req.specifier


def main(argv: list[str]) -> int:
    if argv[:1] == ["missing"]:
        print(" ".join(str(r) for r in project_requirements() if unmet(r)))
        return 0
    if argv[:1] != ["wheels"]:
        print(__doc__, file=sys.stderr)
        return 2
    wheels = [w for d in argv[1:] for w in sorted(pathlib.Path(d).glob("*.whl"))]
    needs: dict[str, list[Requirement]] = {}
    for req in project_requirements() + [r for w in wheels for r in wheel_requirements(w)]:
        needs.setdefault(norm(req.name), []).append(req)
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        if here(name) is None or any(unmet(r) for r in needs.get(norm(name), [])):
            print(wheel)
        else:
            print(f"keeping this machine's {name} {here(name)} (carried: {version})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
