"""The what-if page in a real browser: Debian's Chromium, driven by Playwright, loads the
page from the real server on loopback (a token configured, as in production), takes the
token, adds configs three ways (a bundled example, an upload, pasted text), reads the
matrix and checks every cell against the API's own answer, opens cells from the keyboard
and reads their details, runs the diff view, and saves a screenshot to build/what-if.png.

Nothing may load from outside: every request the page makes is checked to go to the
server's own origin. docs/what-if.png (the README's) is checked against the new
screenshot by dimensions and size, not pixels; `make screenshot` rewrites it.

Skips only where Chromium is absent (`apt-get install chromium`, as .ci/run does).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from integration.serverproc import ServerProcess, launch, wait_ready

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "service" / "http" / "static" / "examples"
SCREENSHOT = ROOT / "build" / "what-if.png"
CHECKED_IN = ROOT / "docs" / "what-if.png"
#: `make screenshot` sets it: write the new screenshot over docs/what-if.png, not compare.
UPDATE = os.environ.get("MOE_CONTROL_SCREENSHOT") == "update"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: How Chromium runs here: headless, no sandbox (root, containers), nothing phoned home.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TOKEN = "page-token"
GPUS = ("a100", "h200", "mi300x", "v100", "xpu", "cpu", "cpu-noamx")
VIEWPORT = {"width": 1400, "height": 1000}

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="Chromium is not installed (apt-get install -y chromium): the browser test of "
    "the what-if page cannot run",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = launch("--http-port", str(_free_port()), "--auth-token", TOKEN)
    try:
        wait_ready(proc)
        yield proc
    finally:
        proc.stop()


def _api(base: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data)
    request.add_header("Authorization", f"Bearer {TOKEN}")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _candidates_in(answer: Any) -> list[Any]:
    """The per-backend verdicts anywhere in an answer (a failure carries them in its
    details), or []."""
    if isinstance(answer, dict):
        if isinstance(answer.get("candidates"), list) and answer["candidates"]:
            return list(answer["candidates"])
        values: list[Any] = list(answer.values())
    elif isinstance(answer, list):
        values = answer
    else:
        return []
    return next((found for v in values if (found := _candidates_in(v))), [])


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def _check_or_update_screenshot() -> None:
    if UPDATE:
        shutil.copyfile(SCREENSHOT, CHECKED_IN)
        return
    assert CHECKED_IN.exists(), "docs/what-if.png is missing: run `make screenshot`"
    new, old = _png_size(SCREENSHOT), _png_size(CHECKED_IN)
    assert new[0] == old[0], f"width {new[0]} != docs/what-if.png's {old[0]}: make screenshot"
    assert abs(new[1] - old[1]) <= 0.1 * old[1], (
        f"height {new[1]} is far from docs/what-if.png's {old[1]}: run `make screenshot`"
    )
    ratio = SCREENSHOT.stat().st_size / CHECKED_IN.stat().st_size
    assert 0.5 <= ratio <= 2, f"size ratio {ratio:.2f} to docs/what-if.png: make screenshot"


def test_the_what_if_page_in_chromium(server: ServerProcess, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    base = server.http_url
    assert base is not None
    origin = urlsplit(base)
    outside: list[str] = []
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport=VIEWPORT)  # a fresh profile of its own

        def only_loopback(route: Any) -> None:
            url = urlsplit(route.request.url)
            if (url.scheme, url.netloc) in {(origin.scheme, origin.netloc), ("data", "")}:
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route("**/*", only_loopback)
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{base}/")

        # The server has a token: the page says so and puts the cursor in the field.
        expect(page.locator("#notice")).to_contain_text("token")
        expect(page.locator("#token")).to_be_focused()
        page.fill("#token", TOKEN)
        page.press("#token", "Enter")
        expect(page.locator("#notice")).to_be_hidden()
        expect(page.locator("#gpus input")).not_to_have_count(0)
        rulesets = [r["name"] for r in _api(base, "/v1/rulesets")[1]]
        platforms = [p["name"] for p in _api(base, "/v1/platforms")[1]]
        assert page.locator("#gpus input").count() == len(platforms)

        # Three ways in: bundled examples, an uploaded file, pasted text (a GELU-tanh
        # variant of the GPTQ example, which some release pairs decide differently).
        for example in ("mixtral-8x7b-instruct-awq", "deepseek-v2-lite-w4a16"):
            page.select_option("#example", example)
            page.click("#example-form button")
        upload = tmp_path / "qwen3-30b-a3b-gptq-int4.json"
        upload.write_text((EXAMPLES / "qwen3-30b-a3b-gptq-int4.json").read_text())
        page.set_input_files("#upload", str(upload))
        gelu = {**json.loads(upload.read_text()), "hidden_act": "gelu_pytorch_tanh"}
        page.fill("#paste", json.dumps(gelu, indent=2))
        page.fill("#paste-name", "qwen3-gelu-tanh")
        page.click("#paste-form button")
        expect(page.locator("#configs li")).to_have_count(4)
        page.fill("#paste", "{not json")
        page.click("#paste-form button")
        expect(page.locator("#notice")).to_contain_text("not JSON")
        page.fill("#paste", "")
        configs = {
            name: json.loads((EXAMPLES / f"{name}.json").read_text())
            for name in ("mixtral-8x7b-instruct-awq", "deepseek-v2-lite-w4a16")
        }
        configs["qwen3-30b-a3b-gptq-int4"] = json.loads(upload.read_text())
        configs["qwen3-gelu-tanh"] = gelu
        names = list(configs)

        # These GPUs, every release.
        for box in page.locator("#gpus input").all():
            box.set_checked(box.get_attribute("value") in GPUS)
        for box in page.locator("#rulesets input").all():
            box.check()
        page.click("#run")
        cells = page.locator("button.cell")
        expect(cells).to_have_count(len(names) * len(GPUS) * len(rulesets))

        # Every cell says what the API says, in text; hazards marked where it has them.
        status, matrix = _api(
            base,
            "/v1/select:matrix",
            {
                "configs": [{"name": n, "config": configs[n]} for n in names],
                "gpus": sorted(GPUS, key=platforms.index),
                "rulesets": rulesets,
            },
        )
        assert status == 200
        shown = {
            (c["model"], c["ruleset"], c["gpu"]): c
            for c in page.eval_on_selector_all(
                "button.cell",
                "bs => bs.map(b => ({model: b.dataset.model, ruleset: b.dataset.ruleset, "
                "gpu: b.dataset.gpu, text: b.querySelector('.label').textContent, "
                "hazard: b.classList.contains('hazard'), mark: b.textContent.includes('⚠'), "
                "label: b.getAttribute('aria-label')}))",
            )
        }
        outcome_text = {"fails": "FAILS", "invalid": "invalid", "unquantized": "unquantized"}
        for cell in matrix["cells"]:
            on_page = shown[(cell["model"], cell["ruleset"], cell["gpu"])]
            expected = cell["backend"] if cell["outcome"] == "chosen" else None
            assert on_page["text"] == (expected or outcome_text[cell["outcome"]]), cell
            assert on_page["hazard"] == on_page["mark"] == bool(cell["hazards"]), cell
            for hazard in cell["hazards"]:
                assert hazard["code"] in on_page["label"]
        assert any(c["hazards"] for c in matrix["cells"]), "no hazard cell to show"
        assert any(c["outcome"] == "fails" for c in matrix["cells"]), "no failing cell"

        # The cells come next in the tab order, right after the button that made them.
        page.focus("#run")
        page.keyboard.press("Tab")
        first = page.evaluate("document.activeElement.dataset.model")
        assert first == names[0] and page.evaluate("document.activeElement.className").startswith(
            "cell"
        )

        # A hazard cell, opened from the keyboard (Enter): its whole answer.
        # (a CUDA one where there is one: the richer answer for the screenshot)
        marked = [c for c in matrix["cells"] if c["hazards"]]
        hazard = next((c for c in marked if c["platform"]["device"] == "cuda"), marked[0])
        button = page.locator(
            f'button.cell[data-model="{hazard["model"]}"][data-ruleset="{hazard["ruleset"]}"]'
            f'[data-gpu="{hazard["gpu"]}"]'
        )
        button.focus()
        outline = button.evaluate("b => getComputedStyle(b).outlineStyle")
        page.keyboard.press("Enter")
        expect(page.locator("#details-backend")).to_have_text(hazard["backend"])
        status, answer = _api(
            base,
            "/v1/select",
            {
                "config": configs[hazard["model"]],
                "platform": hazard["gpu"],
                "ruleset": hazard["ruleset"],
            },
        )
        assert status == 200
        rows = page.locator("#details table.candidates tbody tr")
        expect(rows).to_have_count(len(answer["candidates"]))
        for row, candidate in zip(rows.all(), answer["candidates"], strict=True):
            texts = row.locator("th, td").all_inner_texts()
            assert texts[0] == candidate["backend"]
            assert texts[2].startswith(candidate["reason"] or "—")
            assert texts[3] == (candidate["explanation"] or "—")
        for code in (h["code"] for h in answer["hazards"]):
            expect(page.locator("#details .hazards")).to_contain_text(code)
        hints = answer["what_would_change"]
        if hints:
            expect(page.locator("#details ul.changes li")).to_have_count(len(hints))
        else:
            expect(page.locator("#details")).to_contain_text("No change of at most two")
        assert outline != "none", "a focused cell shows no focus ring"

        # A failing cell, opened with Space: vLLM's error and each backend's reason.
        # (one vLLM judged backends for: some releases fail before the oracle, with none)
        def judged(cell: dict[str, Any]) -> bool:
            body = {"config": configs[cell["model"]], "platform": cell["gpu"]}
            answer = _api(base, "/v1/select", {**body, "ruleset": cell["ruleset"]})[1]
            return bool(_candidates_in(answer))

        fails = next(c for c in matrix["cells"] if c["outcome"] == "fails" and judged(c))
        failing = page.locator(
            f'button.cell[data-model="{fails["model"]}"][data-ruleset="{fails["ruleset"]}"]'
            f'[data-gpu="{fails["gpu"]}"]'
        )
        failing.focus()
        page.keyboard.press("Space")
        expect(page.locator("#details-backend")).to_contain_text("FAILS")
        message = fails["problem"].split(": ", 1)[1]
        expect(page.locator("#details-outcome")).to_contain_text(message)
        expect(page.locator("#details table.candidates tbody tr")).not_to_have_count(0)

        # The diff view between the first and the last release, for the first model and
        # GPU whose answer the API says changes (else the hazard cell's): what POST /v1/diff
        # answers, or, from a server without the route, that it is unavailable.
        def diff_of(model: str, gpu: str) -> tuple[int, Any]:
            body = {
                "from": rulesets[0],
                "to": rulesets[-1],
                "deployment": {"config": configs[model], "platform": gpu},
            }
            return _api(base, "/v1/diff", body)

        pair = next(
            ((m, g) for m in names for g in GPUS if diff_of(m, g)[1].get("changed")),
            (hazard["model"], hazard["gpu"]),
        )
        status, diff = diff_of(*pair)
        page.select_option("#diff-model", pair[0])
        page.select_option("#diff-gpu", pair[1])
        page.select_option("#diff-from", rulesets[0])
        page.select_option("#diff-to", rulesets[-1])
        page.click("#diff-form button")
        if status == 404 and diff["error"]["details"][0].get("resource_type") == "route":
            expect(page.locator("#diff-outcome")).to_contain_text("Diff unavailable")
        else:
            assert status == 200, diff
            expect(page.locator("#diff-outcome")).to_contain_text(
                "Changed" if diff["changed"] else "Unchanged"
            )
            for table, key in (
                ("#diff-table", "differences"),
                ("#diff-other-table", "other_differences"),
            ):
                rows = page.locator(f"{table} tbody tr")
                expect(rows).to_have_count(len(diff[key]))
                for row, difference in zip(rows.all(), diff[key], strict=True):
                    cells = row.locator("th, td").all_inner_texts()
                    assert cells[0] == difference["field"]
                    assert cells[3] == (difference["cause"] or "—")

        # The screenshot shows the hazard cell's details.
        button.click()
        expect(page.locator("#details-backend")).to_have_text(hazard["backend"])
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        context.close()
        browser.close()
    assert outside == [], f"the page asked for something outside the server: {outside}"
    assert errors == [], f"the page raised: {errors}"
    _check_or_update_screenshot()
