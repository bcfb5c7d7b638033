"""POST /v1/select:matrix against POST /v1/select, cell by cell: every cell of configs x
GPUs x every ruleset says what the single select of that config on that GPU under that
ruleset answers (the backend, the hazards, or vLLM's failure), whether the cell was decided
or served from the answer cache (a matrix asked again), and each served cell counts its
decision (or failure, and the rejections) again as a fresh one does."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from service.api.codecs.answer_cache import AnswerCache
from service.metrics import Metrics
from service.oracle import PLATFORM_PRESETS, RULESETS

from .conftest import CONFIG, make_client

EXAMPLES = Path(__file__).resolve().parents[2] / "service" / "http" / "static" / "examples"


def _configs() -> list[dict[str, Any]]:
    configs = [{"name": "qwen2", "config": CONFIG}]
    for path in sorted(EXAMPLES.glob("*.json")):
        config = json.loads(path.read_text())
        configs.append({"name": path.stem, "config": config})
        varied = copy.deepcopy(config)  # a variant some releases refuse or decide otherwise
        varied["quantization_config"]["desc_act"] = True
        configs.append({"name": f"{path.stem}-actorder", "config": varied})
    return configs


#: What a decision counts: the backend chosen, the failure vLLM would raise, the
#: rejections on the way.
COUNTED = (
    "moe_control_backend_selections",
    "moe_control_decision_failures",
    "moe_control_backend_rejections",
)


def _counts(metrics: Metrics) -> dict[str, float]:
    return {
        family.name: sum(s.value for s in family.samples if s.name.endswith("_total"))
        for family in metrics.registry.collect()
        if family.name in COUNTED
    }


def _since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def test_every_cell_is_the_single_select_and_a_kept_matrix_is_the_same() -> None:
    cache = AnswerCache(32 << 20)
    client, metrics = make_client(cache=cache)
    configs = _configs()
    gpus = ["v100", "a100", "h200", "mi300x"]  # old, Ampere, Hopper, ROCm
    body = {"configs": configs, "gpus": gpus, "rulesets": list(RULESETS)}
    with client:
        before = _counts(metrics)
        first = client.post("/v1/select:matrix", json=body)
        middle, hits = _counts(metrics), cache.hits
        second = client.post("/v1/select:matrix", json=body)  # every cell kept now
        assert first.status_code == second.status_code == 200
        assert first.json() == second.json()
        counted = _since(before, middle)
        assert counted == _since(middle, _counts(metrics))
        assert set(counted) == set(COUNTED) and all(n > 0 for n in counted.values())
        cells = first.json()["cells"]
        assert len(cells) == len(configs) * len(gpus) * len(RULESETS)
        assert cache.hits - hits == len(cells)
        config_of = {c["name"]: c["config"] for c in configs}
        outcomes = set()
        for cell in cells:
            single = client.post(
                "/v1/select",
                json={
                    "config": config_of[cell["model"]],
                    "platform": cell["gpu"],
                    "ruleset": cell["ruleset"],
                },
            )
            answer = single.json()
            where = (cell["model"], cell["gpu"], cell["ruleset"])
            outcomes.add(cell["outcome"])
            if cell["outcome"] == "fails":
                assert single.status_code == 400, where
                assert answer["error"]["message"].endswith(cell["problem"]), where
                continue
            assert single.status_code == 200, where
            assert cell["backend"] == answer["backend"], where
            hazards = [{"code": h["code"], "message": h["message"]} for h in answer["hazards"]]
            assert cell["hazards"] == hazards, where
            assert cell["platform"] == PLATFORM_PRESETS[cell["gpu"]].to_json(), where
    assert {"chosen", "fails"} <= outcomes
