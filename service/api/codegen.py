"""Generate the Python code and `.pyi` stubs of the contract in `protos/` (`make protos`).

grpcio-tools writes imports that mirror the proto paths (`from moe_control.v1 import x_pb2`);
the generated package lives at `service.api.generated`, so the imports of every package under
`protos/` (ours, and gRPC's reflection v1, which grpcio-reflection does not ship) are rewritten
to `from service.api.generated.moe_control.v1 import x_pb2`. The checked-in code must equal what
this module writes (tests/api/test_codegen.py regenerates into a temporary directory).

The vLLM plugin (`plugin/`, a distribution of its own that depends on nothing of the server)
gets its own code for the one self-contained proto it speaks (`PLUGIN_PROTOS`), messages only
(it calls the method by name, so no `*_pb2_grpc.py` ties it to a grpcio release), under
`plugin/moe_control_vllm/generated/`; tests/api/test_codegen.py checks that drift as well.

Needs the dev extra (grpcio-tools, pinned to the grpcio of the oldest runtime we serve on).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
GENERATED_ROOT = Path(__file__).resolve().parent / "generated"
#: The Python package the generated modules live in.
GENERATED_PACKAGE = "service.api.generated"
#: The protos the vLLM plugin speaks (self-contained: well-known imports only), and where
#: its generated message modules live.
PLUGIN_PROTOS = ("moe_control/v1/observed.proto",)
PLUGIN_GENERATED_ROOT = REPO_ROOT / "plugin" / "moe_control_vllm" / "generated"


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(proto_root.rglob("*.proto"))


def proto_packages(proto_root: Path = PROTO_ROOT) -> list[str]:
    """The dotted packages of the protos (their directories: buf's PACKAGE_DIRECTORY_MATCH)."""
    return sorted(
        {".".join(p.parent.relative_to(proto_root).parts) for p in proto_files(proto_root)}
    )


def module_name(proto: Path, proto_root: Path = PROTO_ROOT) -> str:
    """The generated message module of one proto (`service.api.generated.<package>.x_pb2`)."""
    parts = proto.relative_to(proto_root).with_suffix("").parts
    return ".".join((GENERATED_PACKAGE, *parts)) + "_pb2"


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` for every proto under `out_dir`.

    Returns the written files, relative to `out_dir`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = [str(p.relative_to(proto_root)) for p in proto_files(proto_root)]
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    subprocess.run(command, check=True, cwd=proto_root)
    packages = "|".join(re.escape(package) for package in proto_packages(proto_root))
    generated_import = re.compile(rf"^from ({packages}) import ", re.MULTILINE)
    written: list[Path] = []
    for path in sorted(out_dir.rglob("*_pb2*.py*")):
        text = path.read_text()
        fixed = generated_import.sub(rf"from {GENERATED_PACKAGE}.\1 import ", text)
        if fixed != text:
            path.write_text(fixed)
        written.append(path.relative_to(out_dir))
    return written


def generate_plugin(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Write the plugin's `*_pb2.py` and `*_pb2.pyi` for `PLUGIN_PROTOS` under `out_dir`.

    Returns the written files, relative to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *PLUGIN_PROTOS,
    ]
    subprocess.run(command, check=True, cwd=proto_root)
    return sorted(path.relative_to(out_dir) for path in out_dir.rglob("*_pb2.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GENERATED_ROOT, help="output root")
    parser.add_argument(
        "--plugin-out", type=Path, default=PLUGIN_GENERATED_ROOT, help="the plugin's output root"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(args.out / path)
    for path in generate_plugin(args.plugin_out):
        print(args.plugin_out / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
