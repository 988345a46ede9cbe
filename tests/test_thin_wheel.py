"""scripts/thin_wheel.py rewrites a carried wheel without the files a run never loads (libucx's
static archives, tools, third library copies), so that every carried wheel fits one device call.

These thin real wheel files built in tmp and install the result with pip: what was dropped is
gone, what was kept is byte for byte the same (with its file mode) and compressed, the RECORD matches the kept
files, the .dist-info survives any pattern, and pip installs the thinned wheel.
"""

import base64
import hashlib
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = "twthin-1.0.dist-info"
FILES = {
    "twthin/__init__.py": b"VALUE = 7\n",
    "twthin/lib/libtw.so": b"\x7fELF shared " * 500,
    "twthin/lib/libtw.so.0": b"\x7fELF shared " * 500,
    "twthin/lib/libtw.so.0.0.0": b"\x7fELF shared " * 500,
    "twthin/lib/libtw.a": b"!<arch>\n" + b"static " * 4000,
    "twthin/bin/tool": b"#!/bin/sh\necho tool\n",
    "twthin/include/tw.h": b"int tw(void);\n",
    f"{DIST}/METADATA": b"Metadata-Version: 2.1\nName: twthin\nVersion: 1.0\n",
    f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tensorwire-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
EXECUTABLE = {"twthin/lib/libtw.so", "twthin/lib/libtw.so.0", "twthin/bin/tool"}


def _wheel(folder: Path) -> Path:
    folder.mkdir()
    path = folder / "twthin-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in FILES.items():
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 2, 3, 4, 6))
            info.external_attr = (0o755 if name in EXECUTABLE else 0o644) << 16
            z.writestr(info, data)
        z.writestr(f"{DIST}/RECORD", "".join(f"{n},,\n" for n in [*FILES, f"{DIST}/RECORD"]))
    return path


def _thin(wheel: Path, dest: Path, *patterns: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "scripts/thin_wheel.py", str(wheel), str(dest), *patterns],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_drops_what_matches_and_keeps_the_rest_byte_for_byte(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "in")
    proc = _thin(wheel, tmp_path / "out", "*.a", "*.so.0.0.0", "twthin/bin/*", "twthin/include/*")
    assert "4 files dropped" in proc.stdout, proc.stdout
    with zipfile.ZipFile(tmp_path / "out" / wheel.name) as z:
        kept = {i.filename: i for i in z.infolist()}
        assert set(kept) == {
            "twthin/__init__.py",
            "twthin/lib/libtw.so",
            "twthin/lib/libtw.so.0",
            f"{DIST}/METADATA",
            f"{DIST}/WHEEL",
            f"{DIST}/RECORD",
        }
        for name, info in kept.items():
            if name != f"{DIST}/RECORD":
                assert z.read(name) == FILES[name], name
                assert stat.S_IMODE(info.external_attr >> 16) == (0o755 if name in EXECUTABLE else 0o644), name
        record = z.read(f"{DIST}/RECORD").decode().split()
    raw = sum(len(FILES[n]) for n in kept if n != f"{DIST}/RECORD")
    assert (tmp_path / "out" / wheel.name).stat().st_size < raw / 4, "the kept files were not compressed"
    rows = {line.split(",")[0]: line.split(",")[1:] for line in record}
    assert set(rows) == set(kept)
    assert rows[f"{DIST}/RECORD"] == ["", ""]
    for name in set(kept) - {f"{DIST}/RECORD"}:
        digest = base64.urlsafe_b64encode(hashlib.sha256(FILES[name]).digest()).rstrip(b"=").decode()
        assert rows[name] == [f"sha256={digest}", str(len(FILES[name]))], name


def test_the_dist_info_survives_any_pattern_and_unmatched_patterns_are_reported(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "in")
    proc = _thin(wheel, tmp_path / "out", "*", "*.nothing")
    with zipfile.ZipFile(tmp_path / "out" / wheel.name) as z:
        assert sorted(z.namelist()) == sorted([f"{DIST}/METADATA", f"{DIST}/WHEEL", f"{DIST}/RECORD"])
    assert "pattern '*.nothing' matched nothing" in proc.stdout
    assert "pattern '*' matched" not in proc.stdout


def test_pip_installs_the_thinned_wheel(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "in")
    _thin(wheel, tmp_path / "out", "*.a", "twthin/bin/*")
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(tmp_path / "out" / wheel.name),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (target / "twthin/__init__.py").read_bytes() == FILES["twthin/__init__.py"]
    assert (target / "twthin/lib/libtw.so.0").read_bytes() == FILES["twthin/lib/libtw.so.0"]
    assert not (target / "twthin/lib/libtw.a").exists() and not (target / "twthin/bin").exists()
    assert (target / DIST / "METADATA").exists()


def test_refuses_to_overwrite_its_input_and_prints_usage_without_arguments(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "in")
    proc = subprocess.run(
        [sys.executable, "scripts/thin_wheel.py", str(wheel), str(tmp_path / "in"), "*.a"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "would overwrite its own input" in proc.stderr
    assert zipfile.ZipFile(wheel).read("twthin/lib/libtw.a") == FILES["twthin/lib/libtw.a"]
    usage = subprocess.run(
        [sys.executable, "scripts/thin_wheel.py"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert usage.returncode == 2 and "thin_wheel.py WHEEL DEST_DIR PATTERN" in usage.stderr
