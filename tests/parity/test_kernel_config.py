"""`--moe-backend` spellings through vLLM 0.33.0's own parser, against the oracle, exactly.

The whole grid proves the same; this test names the cases so that a failure reads plainly:
an upper-case name forced as vLLM forces it, a hyphenated one normalised, a KernelConfig name
the WNA16 selection does not map, and an unknown one refused with argparse's exact text.
"""

from __future__ import annotations

import pytest

from service.oracle import PLATFORM_PRESETS, parse_deployment
from tests.parity.compare import differences, ours
from tests.parity.runner import run_reference
from tests.parity.test_parity import _vllm_python

pytestmark = pytest.mark.parity

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336}
NAMES = ("TRITON", "flashinfer-trtllm", "DEEP-GEMM", "Bogus")


def _spec(name: str) -> dict[str, object]:
    spec = parse_deployment(
        {
            "hf_quantization_config": GPTQ,
            "layer": LAYER,
            "platform": PLATFORM_PRESETS["mi300x"].to_json(),
            "moe_backend": name,
        }
    ).to_json()
    return {"id": name, **spec}


def test_moe_backend_spellings_answer_as_vllm_serve_does() -> None:
    specs = [_spec(name) for name in NAMES]
    answers = {a["id"]: a for a in run_reference(_vllm_python(), specs)}
    for spec in specs:
        assert differences(answers[spec["id"]], ours(spec)) == [], spec["id"]
    assert answers["TRITON"]["backend"] == "TRITON"
    assert "'FLASHINFER_TRTLLM'" in answers["flashinfer-trtllm"]["error"]["message"]
    assert answers["DEEP-GEMM"]["error"]["message"].startswith("moe_backend='deep_gemm'")
    refused = answers["Bogus"]["error"]
    assert (refused["stage"], refused["type"]) == ("kernel_config", "ArgumentError")
    assert refused["message"].startswith("argument --moe-backend: invalid choice: 'bogus' (")
