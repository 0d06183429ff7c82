"""The web console's routes on the router (docs/console.md): GET / and its static files,
shipped in the package (router/web/, no build step, nothing from another origin), and
GET /console/state (router/console.py).

The static files hold no secret, so they are served without the API key (the page asks
for the key and sends it as a bearer header); /console/state needs the key like every
other route. The page's Content-Security-Policy allows scripts, styles and requests to
this origin only, so even a rendering bug cannot run model output as script.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pdserve.router.console import ConsoleFeed

FILES = {  # URL path -> (file in router/web/, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/console/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/console/api.js": ("api.js", "text/javascript; charset=utf-8"),
    "/console/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/console/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/console/live.js": ("live.js", "text/javascript; charset=utf-8"),
    "/console/style.css": ("style.css", "text/css; charset=utf-8"),
    "/console/icon.svg": ("icon.svg", "image/svg+xml"),
}
OPEN_PATHS = frozenset(FILES)  # served without the API key (edge/auth.py)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def load_files() -> dict[str, tuple[bytes, str]]:
    """URL path -> (bytes, media type), read once from the package."""
    web = resources.files("pdserve.router") / "web"
    return {path: ((web / name).read_bytes(), media) for path, (name, media) in FILES.items()}


def page_bytes() -> int:
    """The console's total size on the wire, uncompressed (docs/console.md)."""
    return sum(len(body) for body, _ in load_files().values())


AUTH_META = b'<meta name="pdserve-auth" content="none">'


def add_web_ui(app: FastAPI, feed: ConsoleFeed, key_required: bool) -> None:
    """`key_required`: the page asks for the API key before its first request (it says
    only what any 401 would say)."""
    files = load_files()
    if key_required:
        html, media = files["/"]
        assert AUTH_META in html
        files["/"] = (html.replace(AUTH_META, AUTH_META.replace(b"none", b"required")), media)

    def static(path: str) -> Any:
        body, media = files[path]

        async def serve() -> Response:
            return Response(body, media_type=media, headers=HEADERS)

        return serve

    for path in files:
        app.add_api_route(path, static(path), methods=["GET"], include_in_schema=False)

    @app.get("/console/state", include_in_schema=False)
    async def console_state() -> Response:
        return JSONResponse(await feed.state(), headers={"cache-control": "no-store"})
