"""The fleet matrix over a server against the local command: `moe-control select --config
DIR --gpu all --ruleset <every release> [--server HOST:PORT] --json`, wall time of the
whole command (interpreter start included), both printing the same JSON.

A directory of `--rows` configs (each of its own expert size, so every run's cells are new
to the server's answer cache unless `--warm`) by every preset by every ruleset. Each round
runs the local command, then the remote one against a server started here (one process,
the CPU worker); the table gives the median of `--rounds`.

    python bench/matrix_remote_bench.py [--rows 6] [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_results
from _serve import listening, serve_command
from stall_bench import CONFIG

from service.oracle import PLATFORM_PRESETS, RULESETS


def write_fleet(root: Path, rows: int, round_: int) -> None:
    root.mkdir(parents=True)
    for row in range(rows):
        config = {**CONFIG, "moe_intermediate_size": 128 * (1 + row + rows * round_)}
        (root / f"model-{row}.json").write_text(json.dumps(config))


def timed(argv: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    took = time.perf_counter() - started
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return took, done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6, help="configs (rows)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm", action="store_true", help="the same configs every round")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cells = args.rows * len(PLATFORM_PRESETS) * len(RULESETS)
    server = subprocess.Popen(
        serve_command("--log-level", "WARNING"), stdout=subprocess.PIPE, text=True
    )
    local_s, remote_s = [], []
    try:
        assert server.stdout is not None
        match = listening(server.stdout.readline().strip())
        assert match is not None, "the server did not start"
        server.stdout.readline()  # ready
        with tempfile.TemporaryDirectory() as scratch:
            for round_ in range(args.rounds):
                root = Path(scratch) / f"fleet-{round_}"
                write_fleet(root, args.rows, 0 if args.warm else round_)
                select = [sys.executable, "-m", "service.cli", "select", "--config", str(root)]
                select += ["--gpu", "all", "--ruleset", ",".join(RULESETS), "--json"]
                took, local = timed(select)
                local_s.append(took)
                took, remote = timed([*select, "--server", match.group(1)])
                remote_s.append(took)
                assert remote == local, "the remote matrix differs from the local one"
    finally:
        server.terminate()
        server.wait(30)
    local, remote = statistics.median(local_s), statistics.median(remote_s)
    markdown = "\n".join(
        [
            f"{cells} cells ({args.rows} configs x {len(PLATFORM_PRESETS)} presets x "
            f"{len(RULESETS)} rulesets), {'warm' if args.warm else 'cold'} server cache, "
            f"{os.cpu_count()} CPUs, median of {args.rounds}",
            "",
            "| command | seconds (whole command) |",
            "| --- | --- |",
            f"| local `select --config` | {local:.2f} |",
            f"| `select --config ... --server` (one SelectMatrix) | {remote:.2f} |",
            "",
            f"remote / local: {remote / local:.2f}x",
        ]
    )
    print(markdown)
    write_results(args.out, "matrix_remote", markdown, {"local_s": local_s, "remote_s": remote_s})
    return 0


if __name__ == "__main__":
    sys.exit(main())
