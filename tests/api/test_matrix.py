"""service.api.matrix: a matrix decided through the process's selector, every cell what a
single select answers, kept cells served from the answer cache and counted again, the
platform flags laid over each preset, and cells a spent budget did not reach marked, never
dropped."""

from __future__ import annotations

import math

from service.api.codecs.answer_cache import AnswerCache
from service.api.matrix import decide_matrix
from service.dataplane.matrix import EXIT_NOT_DECIDED, MatrixModel, MatrixQuery
from service.dataplane.offload import Budget
from service.dataplane.selection import Selector
from service.metrics import Metrics
from service.oracle import PLATFORM_PRESETS, preset, select
from tests.api.test_servicer import GPTQ, LAYER, Platforms

SPEC = {"hf_quantization_config": GPTQ, "layer": LAYER}
GPUS = ["a100", "h100", "mi300x"]
RULESETS = ["vllm-0.32", "vllm-0.33"]


def query(**platform: object) -> MatrixQuery:
    models = [MatrixModel("gptq", "here", SPEC), MatrixModel("tp2", "here", {**SPEC, "id": 2})]
    return MatrixQuery(models, GPUS, RULESETS, platform)


def selections(metrics: Metrics) -> float:
    total = 0.0
    for family in metrics.registry.collect():
        if family.name == "moe_control_backend_selections":
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def test_every_cell_is_the_single_answer_and_kept_cells_count_again() -> None:
    metrics = Metrics()
    selector = Selector(Platforms(PLATFORM_PRESETS["a100"]), metrics)
    cache = AnswerCache(1 << 20)
    first = decide_matrix(selector, cache, query(), Budget(math.inf))
    for cell in first.cells:
        expected = select({**SPEC, "platform": cell.gpu}, ruleset=cell.ruleset)
        assert (cell.outcome, cell.backend) == ("chosen", expected.backend)
    assert selections(metrics) == len(first.cells)
    misses = cache.misses
    again = decide_matrix(selector, cache, query(), Budget(math.inf))
    assert again == first
    assert cache.misses == misses  # every cell from the cache
    assert selections(metrics) == 2 * len(first.cells)


def test_the_platform_flags_are_laid_over_each_preset() -> None:
    selector = Selector(Platforms(None), Metrics())
    matrix = decide_matrix(
        selector, None, query(packages=[], env={"VLLM_BATCH_INVARIANT": "1"}), Budget(math.inf)
    )
    for cell in matrix.cells:
        assert cell.platform is not None
        assert cell.platform["packages"] == []
        assert cell.platform["env"] == {**preset(cell.gpu).env, "VLLM_BATCH_INVARIANT": "1"}


def test_cells_a_spent_budget_did_not_reach_say_so() -> None:
    selector = Selector(Platforms(None), Metrics())
    matrix = decide_matrix(selector, None, query(), Budget(0.0))
    assert len(matrix.cells) == 2 * len(GPUS) * len(RULESETS)
    for cell in matrix.cells:
        assert (cell.outcome, cell.exit_code) == ("error", EXIT_NOT_DECIDED)
        assert cell.problem is not None and cell.problem.startswith("DEADLINE_EXCEEDED")
    assert matrix.exit_code == EXIT_NOT_DECIDED
