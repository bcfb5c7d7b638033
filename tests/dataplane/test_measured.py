"""service/dataplane/measured.py without a server: the persisted cache, keys, and the
answer's arithmetic (fastest per token count, vLLM's choice beside it, the speedup)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.dataplane import measured
from service.oracle import InvalidSpecError


def entry(times: dict[int, dict[str, float | None]]) -> dict[str, object]:
    return {
        "device_name": "NVIDIA H200",
        "versions": {"torch": "2.11.0"},
        "buckets": {
            str(tokens): {
                "time": 1_700_000_000.0 + tokens,
                "timings": [
                    {"backend": b, "seconds": s, "error": "" if s is not None else "no CUDA"}
                    for b, s in row.items()
                ],
            }
            for tokens, row in times.items()
        },
    }


def job(tokens: tuple[int, ...]) -> measured.Job:
    return measured.Job(0, "k", {"device": "NVIDIA H200"}, {}, tokens, measured.RUNNABLE)


def test_summary_picks_the_fastest_and_sets_vllm_choice_beside_it() -> None:
    data = entry(
        {
            1: {"HUMMING": 36e-6, "MARLIN": 35e-6, "TRITON": 20e-6, "EMULATION": 9e-3},
            4096: {"HUMMING": 7.5e-4, "MARLIN": 1.4e-3, "TRITON": None, "EMULATION": 0.2},
        }
    )
    summary = measured.summarize(job((1, 4096)), data, "MARLIN")
    one, big = summary.buckets
    assert one.fastest == (20e-6, "TRITON")
    assert one.static_backend == "MARLIN" and one.static_seconds == 35e-6
    assert one.speedup == pytest.approx(1.75)
    assert big.fastest is not None and big.fastest[1] == "HUMMING"
    assert big.speedup == pytest.approx(1.4e-3 / 7.5e-4)
    (triton,) = [t for t in big.timings if t.backend == "TRITON"]
    assert triton.seconds is None and triton.error == "no CUDA"
    assert summary.device_name == "NVIDIA H200" and summary.versions["torch"] == "2.11.0"
    assert summary.measured_time == 1_700_000_001.0  # the oldest bucket's


def test_summary_without_a_runnable_static_choice() -> None:
    summary = measured.summarize(job((1,)), entry({1: {"EMULATION": 1e-3}}), "CPU")
    (bucket,) = summary.buckets
    assert bucket.fastest == (1e-3, "EMULATION")
    assert bucket.static_seconds is None and bucket.speedup is None


def test_store_persists_atomically_and_survives_damage(tmp_path: Path) -> None:
    store = measured.MeasureStore(tmp_path)
    store.put("abc", {"buckets": {"1": {"time": 1.0, "timings": []}}})
    path = tmp_path / measured.CACHE_FILE
    assert json.loads(path.read_text())["entries"]["abc"]["buckets"]["1"]["time"] == 1.0
    assert [p.name for p in tmp_path.iterdir()] == [measured.CACHE_FILE]  # no temporaries
    assert measured.MeasureStore(tmp_path).get("abc") == store.get("abc")
    path.write_text("{not json")
    assert measured.MeasureStore(tmp_path).get("abc") is None  # re-measured, not an error
    memory = measured.MeasureStore(None)
    memory.put("x", {})
    assert memory.get("x") == {} and memory.path is None


def test_cache_key_depends_on_every_part() -> None:
    parts = {"device": "NVIDIA H200", "shape": {"num_experts": 8}, "torch": "2.11"}
    key = measured.cache_key(parts)
    assert key == measured.cache_key(dict(reversed(list(parts.items()))))
    for field, value in (("device", "NVIDIA H100"), ("torch", "2.12")):
        assert measured.cache_key({**parts, field: value}) != key
    assert measured.cache_key({**parts, "shape": {"num_experts": 16}}) != key


@pytest.mark.parametrize("counts", [[0], [1, 16385], list(range(1, 18))])
def test_token_counts_are_bounded(counts: list[int]) -> None:
    with pytest.raises(InvalidSpecError) as info:
        measured.token_counts(tuple(counts))
    assert info.value.violations[0].field == "token_counts"


def test_token_counts_default_and_dedupe() -> None:
    assert measured.token_counts(()) == measured.DEFAULT_TOKENS
    assert measured.token_counts((16, 1, 16)) == (1, 16)
