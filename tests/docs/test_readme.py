"""The README stays a five-minute read whose set-up matches the Makefile and CI, and the
pages agree with the code where they used to contradict each other."""

from __future__ import annotations

import re

from service.settings import Settings
from tests.docs.markdown import ROOT, pages, prose

README = ROOT / "README.md"


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


def makefile_default(variable: str) -> str:
    match = re.search(rf"^{variable} \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, variable
    return match.group(1)


def test_the_readme_is_at_most_200_lines() -> None:
    assert len(README.read_text().splitlines()) <= 200


def test_every_make_target_the_pages_name_exists() -> None:
    targets = makefile_targets()
    commands = re.compile(r"(?:`|^)make ([a-z][\w-]*)", re.M)  # in code, not prose
    named = {t for page in pages() for t in commands.findall(page.read_text())}
    assert {"run", "test"} <= named
    assert named - targets == set(), f"no such make targets: {named - targets}"


def test_the_setup_section_matches_the_makefile_and_ci() -> None:
    text = README.read_text()
    host, port = makefile_default("HOST"), makefile_default("PORT")
    metrics_port = makefile_default("METRICS_PORT")
    assert (host, int(port), int(metrics_port)) == (
        Settings().host,
        Settings().port,
        Settings().metrics_port,
    ), "make run serves somewhere else than the server's defaults"
    assert f"{host}:{port}" in text and f":{metrics_port}" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), ".ci/run no longer runs the README's command"


def test_readiness_is_described_as_the_code_does_it() -> None:
    """SERVING while at least one worker is ready (WorkerPool.ready), nowhere 'every'."""
    for page in pages():
        flat = " ".join(prose(page).split())
        assert "every worker is ready" not in flat, page.name
    server = " ".join((ROOT / "docs" / "server.md").read_text().split())
    assert "SERVING while at least one worker is ready" in server
