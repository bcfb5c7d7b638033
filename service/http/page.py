"""The what-if page: static files shipped in the package (`service/http/static/`), served
at `/` on the HTTP port beside the API, with no build step and nothing loaded from outside
(plain HTML, CSS and JavaScript modules; docs/http.md).

Every file is read once when the app is built and answered from memory by its name, so no
request path ever reaches the file system. The bundled example configs are the JSON files
in `static/examples/` (docs/examples/fleet is a link to them); `/page/examples.json` lists
them, derived from that folder, so adding an example is adding a file.

The page is public: it holds no data, and every call it makes to the API carries the token
the user typed (the API routes need it as ever). Each answer carries a Content-Security-
Policy that allows this origin only, so a browser refuses anything from outside.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

from service.http.observe import Observer

#: The folder of the page's files, inside this package.
STATIC = "static"
EXAMPLES = "examples"
#: The page's route templates (the metrics' route labels).
INDEX_ROUTE = "/"
FILE_ROUTE = "/page/{name:path}"

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True, slots=True)
class PageFile:
    body: bytes
    media_type: str


def _files(folder: Traversable, prefix: str = "") -> dict[str, PageFile]:
    found: dict[str, PageFile] = {}
    for entry in folder.iterdir():
        name = f"{prefix}{entry.name}"
        if entry.is_dir():
            found.update(_files(entry, f"{name}/"))
            continue
        suffix = entry.name[entry.name.rfind(".") :] if "." in entry.name else ""
        if suffix in _TYPES:
            found[name] = PageFile(entry.read_bytes(), _TYPES[suffix])
    return found


def examples_index(files: dict[str, PageFile]) -> list[dict[str, str]]:
    """The bundled example configs: each one's name (its file name less .json) and path."""
    prefix = f"{EXAMPLES}/"
    names = sorted(name for name in files if name.startswith(prefix) and name.endswith(".json"))
    return [{"name": name[len(prefix) : -len(".json")], "path": f"/page/{name}"} for name in names]


def page_files() -> dict[str, PageFile]:
    """Every file of the page by its name under /page/, and the examples' index."""
    files = _files(resources.files(__package__ or "service.http").joinpath(STATIC))
    index = json.dumps(examples_index(files), separators=(",", ":")).encode()
    files["examples.json"] = PageFile(index, _TYPES[".json"])
    return files


def _not_found() -> Response:
    return Response(b"not found\n", 404, media_type="text/plain", headers=HEADERS)


def page_routes(observer: Observer) -> list[StarletteRoute]:
    """GET / (the page) and GET /page/{name} (its files), each answer counted and timed
    under its route template."""
    files = page_files()
    index = files["index.html"]

    async def page(request: Request) -> Response:
        started = time.perf_counter()
        response = Response(index.body, media_type=index.media_type, headers=HEADERS)
        observer.record("GET", INDEX_ROUTE, 200, time.perf_counter() - started)
        return response

    async def page_file(request: Request) -> Response:
        started = time.perf_counter()
        found = files.get(request.path_params["name"])
        if found is None:
            response = _not_found()
        else:
            response = Response(found.body, media_type=found.media_type, headers=HEADERS)
        observer.record("GET", FILE_ROUTE, response.status_code, time.perf_counter() - started)
        return response

    endpoints: tuple[tuple[str, Callable[[Request], Awaitable[Response]]], ...] = (
        (INDEX_ROUTE, page),
        (FILE_ROUTE, page_file),
    )
    return [StarletteRoute(path, handler, methods=["GET"]) for path, handler in endpoints]
