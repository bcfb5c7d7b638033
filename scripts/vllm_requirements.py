"""Write a vLLM wheel's own requirements, with the pins the package index cannot meet replaced.

`pip install vllm==X.Y.Z` resolves the wheel's `Requires-Dist` lines, and fails outright when one
of them pins a version the index lacks (vLLM 0.34.0 pins `flashinfer-python==0.7.3`, which the
index never had). The workaround is to install the wheel with `--no-deps` and then its
requirements from this list, read from the wheel's own METADATA, so the list follows the
release instead of being copied by hand, with each named pin replaced (`--replace
flashinfer-python==0.7.4`) and the packages that only the multimedia paths need dropped
(`--drop torchvision`: their CUDA builds do not load against the CPU torch, and nothing on the
decision path imports them). Requirements that only an extra asks for are left out.

Standard library only: it runs before any environment of the project exists.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA_MARKER = re.compile(r"\bextra\s*==")


def canonical(name: str) -> str:
    """The PEP 503 form of a distribution name (what pip compares)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def metadata(wheel: Path) -> str:
    """The METADATA text inside a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            parts = member.split("/")
            if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "METADATA":
                return archive.read(member).decode("utf-8")
    raise SystemExit(f"{wheel}: no .dist-info/METADATA inside")


def requirements(text: str, replace: dict[str, str], drop: set[str]) -> list[str]:
    """The unconditional `Requires-Dist` lines of METADATA, replaced and dropped as asked."""
    lines: list[str] = []
    unused = set(replace)
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.removeprefix("Requires-Dist:").strip()
        if _EXTRA_MARKER.search(requirement):
            continue
        match = _NAME.match(requirement)
        if match is None:
            raise SystemExit(f"cannot read a name from requirement {requirement!r}")
        name = canonical(match.group(1))
        if name in drop:
            continue
        if name in replace:
            unused.discard(name)
            marker = requirement.partition(";")[2].strip()
            requirement = replace[name] + (f"; {marker}" if marker else "")
        lines.append(requirement)
    if unused:
        # A replacement that matches nothing means the release changed its pins: say so
        # rather than install something other than what the caller meant.
        raise SystemExit(f"--replace names no requirement of this wheel: {sorted(unused)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print (or write) the requirements of the one vLLM wheel in --wheel-dir."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", type=Path, required=True, help="holds one vllm-*.whl")
    parser.add_argument("--replace", action="append", default=[], metavar="NAME==VERSION")
    parser.add_argument("--drop", action="append", default=[], metavar="NAME")
    parser.add_argument("--out", type=Path, help="write here instead of stdout")
    args = parser.parse_args(argv)
    wheels = sorted(args.wheel_dir.glob("vllm-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"{args.wheel_dir}: expected one vllm-*.whl, found {len(wheels)}")
    replace: dict[str, str] = {}
    for spec in args.replace:
        name, sep, version = spec.partition("==")
        if not sep or not version:
            raise SystemExit(f"--replace {spec!r}: expected NAME==VERSION")
        replace[canonical(name)] = f"{name}=={version}"
    drop = {canonical(name) for name in args.drop}
    lines = requirements(metadata(wheels[0]), replace, drop)
    text = "".join(f"{line}\n" for line in lines)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
