"""bench/http_bench.py on a small scale: a real server on loopback answers the HTTP load
with no error and the library's answer, the gRPC peer runs against the same server, and
the matrix has configs x GPUs x rulesets cells, its configs all distinct MoE configs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import http_bench

from service.dataplane.matrix import model_from_config
from service.oracle import RULESETS


def test_the_matrix_configs_are_distinct_moe_configs() -> None:
    configs = http_bench.matrix_configs(10)
    assert len(configs) == 10
    assert len({c["name"] for c in configs}) == 10
    assert len({json.dumps(c["config"], sort_keys=True) for c in configs}) == 10
    for entry in configs:
        assert model_from_config(entry["name"], "bench", entry["config"]).spec is not None


def test_a_short_run_measures_http_grpc_and_the_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    code = http_bench.main(
        [
            "--rate", "200", "--duration", "1", "--warmup", "20", "--connections", "4",
            "--matrix-configs", "2", "--matrix-gpus", "3", "--matrix-rounds", "2", "--json",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    http, grpc = result["http_select"], result["grpc_select"]
    assert http["errors"] == {} and http["requests"] > 0 and http["p99_ms"] > 0
    assert grpc["errors"] == {} and grpc["requests"] > 0
    assert result["matrix"]["cells"] == 2 * 3 * len(RULESETS)
