"""A MEASURED answer's measured part as protobuf: what the domain leaves unset stays unset
(no static time where vLLM's choice did not run, no device time for a failed backend)."""

from __future__ import annotations

import pytest

from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import measured_pb2
from service.dataplane.selection import Bucket, MeasuredSelection, Timing


def test_measured_part_fields_and_presence() -> None:
    measured = MeasuredSelection(
        worker_index=1,
        device_name="NVIDIA H200",
        versions={"torch": "2.11.0"},
        buckets=(
            Bucket(
                1,
                "MARLIN",
                (Timing("MARLIN", "", 35e-6), Timing("TRITON", "", 20e-6)),
                static_seconds=35e-6,
                fastest=(20e-6, "TRITON"),
                speedup=1.75,
            ),
            Bucket(4096, "CPU", (Timing("TRITON", "no CUDA", None),)),
        ),
        measured_time=1_700_000_001.0,
        from_cache=True,
    )
    message = measured_pb2.MeasuredSelection()
    codec.measured_to_pb(message, measured)
    one, big = message.buckets
    assert (one.fastest_backend, one.fastest_seconds) == ("TRITON", 20e-6)
    assert one.static_backend == "MARLIN" and one.static_seconds == 35e-6
    assert one.speedup == pytest.approx(1.75)
    (triton,) = big.timings
    assert not triton.HasField("device_seconds") and triton.error == "no CUDA"
    assert not big.HasField("static_seconds") and not big.HasField("speedup")
    assert not big.fastest_backend
    assert message.worker_index == 1 and message.versions["torch"] == "2.11.0"
    assert message.measured_time.seconds == 1_700_000_001
    assert message.from_cache and message.measure_seconds == 0.0
