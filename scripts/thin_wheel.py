"""Rewrite a wheel without the files a run never loads, so that it travels in less space.

    python scripts/thin_wheel.py WHEEL DEST_DIR PATTERN...

Writes DEST_DIR/<the same file name>: every member of WHEEL whose path matches none of the
PATTERNs (fnmatch, against the path inside the wheel), recompressed at deflate's highest level,
with a RECORD that lists the kept files' sha256 and sizes. The name, version and metadata stay,
so the thinned wheel satisfies the same requirements as the original. The .dist-info folder is
never dropped. Prints what it dropped and the sizes; a pattern that matches nothing is reported
(the wheel's layout may have changed), and that is not an error.

scripts/gpu_wheels.sh uses it on libucx, whose wheel carries UCX's static archives, perftest and
tools next to the shared libraries ucxx loads: 40 MiB thinned to about 11, so that every carried
wheel fits in one call of the device tool (64 MiB).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import pathlib
import sys
import zipfile


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def thin(wheel: pathlib.Path, dest: pathlib.Path, patterns: list[str]) -> tuple[list[str], list[str]]:
    """Write the thinned copy of `wheel` into `dest`; return (dropped member paths, unmatched patterns)."""
    out = dest / wheel.name
    if out.resolve() == wheel.resolve():
        raise SystemExit(f"thin_wheel: {out} would overwrite its own input")
    dropped: list[str] = []
    used: set[str] = set()
    records: list[str] = []
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        record = [i.filename for i in infos if i.filename.endswith(".dist-info/RECORD")]
        if len(record) != 1:
            raise SystemExit(f"thin_wheel: {wheel.name} is not a wheel (no single .dist-info/RECORD)")
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
            for info in infos:
                name = info.filename
                hits = [p for p in patterns if fnmatch.fnmatch(name, p)]
                if hits and ".dist-info/" not in name:
                    used.update(hits)
                    dropped.append(name)
                    continue
                if name == record[0] or name.endswith("/"):
                    continue
                data = src.read(info)
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                records.append(f"{name},{_digest(data)},{len(data)}")
            records.append(f"{record[0]},,")
            rec = zipfile.ZipInfo(record[0], date_time=src.getinfo(record[0]).date_time)
            rec.external_attr = src.getinfo(record[0]).external_attr
            dst.writestr(rec, "\n".join(records) + "\n", compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dropped, [p for p in patterns if p not in used]


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    wheel, dest, patterns = pathlib.Path(argv[0]), pathlib.Path(argv[1]), argv[2:]
    dropped, unmatched = thin(wheel, dest, patterns)
    before, after = wheel.stat().st_size, (dest / wheel.name).stat().st_size
    mib = 1 << 20
    print(f"{wheel.name}: {len(dropped)} files dropped, {before / mib:.1f} MiB -> {after / mib:.1f} MiB")
    for p in unmatched:
        print(f"  pattern {p!r} matched nothing (has the wheel's layout changed?)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
