"""bench/runmoe_overhead.py's arithmetic: the per-call split and reading the server's metric.

The whole bench (a real server, a kept layer, RunMoE at M = 1 and 4096) runs as
`python bench/runmoe_overhead.py`; it takes tens of seconds, so here only the parts that
decide its figures are checked.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import runmoe_overhead

METRICS = b"""# HELP grpc_server_handling_seconds Time
grpc_server_handling_seconds_bucket{grpc_method="RunMoE",grpc_type="unary",le="0.1"} 2.0
grpc_server_handling_seconds_count{grpc_method="RunMoE",grpc_service="s",grpc_type="unary"} 2.0
grpc_server_handling_seconds_sum{grpc_method="RunMoE",grpc_service="s",grpc_type="unary"} 0.25
grpc_server_handling_seconds_sum{grpc_method="SelectBackend",grpc_service="s",grpc_type="unary"} 9.0
"""


@pytest.fixture
def metrics_url() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS)

        def log_message(self, *args: object) -> None:
            return

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()


def test_handled_seconds_reads_one_method(metrics_url: str) -> None:
    assert runmoe_overhead.handled_seconds(metrics_url, "RunMoE") == (0.25, 2.0)
    assert runmoe_overhead.handled_seconds(metrics_url, "GetPlatform") == (0.0, 0.0)


def test_row_splits_each_call() -> None:
    row = runmoe_overhead.row_of(
        "RunMoE",
        1,
        walls=[0.010, 0.012, 0.011],
        servers=[0.008, 0.009, 0.0085],
        devices=[0.005, 0.005, 0.005],
        sizes=(100, 200),
    )
    assert row.client_wall_ms == pytest.approx(11.0)
    assert row.server_ms == pytest.approx(8.5)
    assert row.server_overhead_ms == pytest.approx(3.5)  # median of server - device
    assert row.transport_ms == pytest.approx(2.5)  # median of wall - server
    assert row.wall_minus_device_ms == pytest.approx(6.0)  # median of wall - device
    assert "| RunMoE | 1 | 3 | 100 | 200 | 11.000" in runmoe_overhead.table([row])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc")
def test_anonymous_rss_grows_with_a_touched_block() -> None:
    before = runmoe_overhead.anonymous_rss_mib(os.getpid())
    block = b"\x01" * (64 << 20)  # written: every page touched
    assert runmoe_overhead.anonymous_rss_mib(os.getpid()) - before > 32
    del block
