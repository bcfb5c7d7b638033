"""Instructions per SelectBackend call in the server process, counted by callgrind.

Why: on the shared 2-core dev machine the server's CPU time per call moves by 15% or more
from one run to the next with the neighbours' load, which hides changes of a few percent
and once made a regression appear that instruction counts do not show (bench/RESULTS.md).
An instruction count is close to deterministic (about 2% run to run), so it is the figure
for comparing two builds of the server; CPU time per call (bench/load_bench.py) remains the
figure for what a call costs.

It starts `moe-control serve --server-processes 1` (plus any `serve` flags after `--`) under
`valgrind --tool=callgrind` from `--tree` (a checkout or `git archive` of the commit to
measure; its `service` package is the one imported), warms it up, zeroes the counters,
makes `--calls` SelectBackend calls from `--connections` connections, dumps the counters
and prints the instructions per call (every thread of the server process; the worker
process is not traced). Loopback only; valgrind slows the server about 50 times, so a run
takes a minute or two.

    .venv/bin/python bench/callgrind_select.py                        # cache hits
    .venv/bin/python bench/callgrind_select.py -- --select-cache-mib 0  # every call decides
    .venv/bin/python bench/callgrind_select.py --tree /tmp/old -- --select-cache-mib 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from _serve import listening, serve_command  # siblings in bench/ (on sys.path)
from load_bench import METHOD
from load_bench import SPEC as LOAD_SPEC

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb

#: load_bench's request (Qwen1.5-MoE GPTQ int4), answered for the A100 preset.
SPEC = {**LOAD_SPEC, "platform": "a100"}


async def drive(target: str, calls: int, connections: int) -> None:
    """`calls` SelectBackend calls, one in flight per connection."""
    payload = pb.SelectBackendRequest(spec_json=json.dumps(SPEC)).SerializeToString()
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(connections)]
    remaining = iter(range(calls))

    async def stream(channel: grpc.aio.Channel) -> None:
        call = channel.unary_unary(METHOD)
        for _ in remaining:
            await call(payload, timeout=600)

    await asyncio.gather(*(stream(channel) for channel in channels))
    for channel in channels:
        await channel.close()


def control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True)


def measure(tree: Path, calls: int, connections: int, serve_args: list[str]) -> dict[str, object]:
    out = Path(tempfile.mkdtemp(prefix="callgrind-select-"))
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/callgrind.%p"]
    command = serve_command("--log-level", "WARNING", *serve_args, prefix=valgrind)
    with open(out / "stderr", "w") as stderr:
        server = subprocess.Popen(
            command, cwd=tree, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    try:
        assert server.stdout is not None
        match = listening(server.stdout.readline())
        if match is None:
            raise SystemExit(f"the server did not start; see {out}/stderr")
        target = match.group(1)
        time.sleep(5)  # the worker reports its profile
        asyncio.run(drive(target, max(200, calls // 2), connections))  # warm-up
        control("--zero", str(server.pid))
        asyncio.run(drive(target, calls, connections))
        control("--dump=measured", str(server.pid))
    finally:
        server.terminate()
        server.wait(120)
    instructions = None
    for path in sorted(out.glob(f"callgrind.{server.pid}.*")):
        text = path.read_text()
        if "measured" in text[:2000]:
            found = re.search(r"^summary: (\d+)", text, re.MULTILINE)
            instructions = int(found.group(1)) if found else None
    shutil.rmtree(out, ignore_errors=True)
    if instructions is None:
        raise SystemExit("no counters were dumped")
    return {
        "tree": str(tree),
        "serve_args": serve_args,
        "calls": calls,
        "connections": connections,
        "instructions_per_call": round(instructions / calls),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("serve_args", nargs="*", help="extra `serve` flags (after --)")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("needs valgrind (callgrind and callgrind_control)")
    print(json.dumps(measure(args.tree, args.calls, args.connections, args.serve_args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
