"""The dashboard's FastAPI app: static page + a small JSON API over the runs' ``verl_logs.jsonl``.

    GET /                      the page (static/index.html; uPlot is served from static/, no CDN)
    GET /api/config            refresh interval and run list
    GET /api/data?cursors=...  per run the metric points after the browser's cursor ("generation:count", one per
                               run, comma-separated), run status, the latest samples and alerts

Only the log files named at start are ever read: no request parameter is a path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from verl.dashboard.runs import RunState, run_label

STATIC = Path(__file__).parent / "static"
# Everything is served by this app itself: the page works offline and loads nothing from elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; object-src 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _parse_cursors(text: str, count: int) -> list[tuple[int, int]]:
    cursors = [(-1, 0)] * count
    if not text:
        return cursors
    parts = text.split(",")
    if len(parts) > count:
        raise HTTPException(400, f"cursors: {len(parts)} given for {count} run(s)")
    for i, part in enumerate(parts):
        generation, sep, cursor = part.partition(":")
        try:
            cursors[i] = (int(generation), int(cursor)) if sep else (-1, 0)
        except ValueError:
            raise HTTPException(400, f"cursors: '{part}' is not 'generation:count'") from None
    return cursors


def create_app(log_paths: list[Path], refresh_seconds: float = 5.0, title: str = "verl dashboard",
               samples_limit: int = 20) -> FastAPI:
    """An app showing the runs whose logs are ``log_paths`` (``verl_logs.jsonl`` files, possibly not there yet)."""
    runs = [RunState(i, run_label(p, log_paths), p) for i, p in enumerate(log_paths)]
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runs = runs

    @app.middleware("http")
    async def security_headers(request, call_next):
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> FileResponse:
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @app.get("/api/config")
    def config() -> dict[str, Any]:
        return {"title": title, "refresh_ms": int(refresh_seconds * 1000),
                "runs": [{"id": r.id, "name": r.name, "path": str(r.log_path)} for r in runs]}

    # Sync endpoints run in FastAPI's threadpool, so reading a large log never blocks the event loop.
    @app.get("/api/data")
    def data(cursors: str = Query("", max_length=20000)) -> JSONResponse:
        parsed = _parse_cursors(cursors, len(runs))
        payload = []
        for run, (generation, cursor) in zip(runs, parsed, strict=True):
            run.refresh()
            payload.append(run.delta(generation, cursor))
        # Each run gets its share of the table, so runs being compared all show their latest generations.
        share = max(1, samples_limit // max(1, len(runs)))
        samples = sorted((s for r in runs for s in r.latest("samples", share)),
                         key=lambda s: (s.get("step") or 0, str(s.get("timestamp") or ""), -s["run_id"]), reverse=True)
        alerts = sorted((a for r in runs for a in r.latest("alerts", samples_limit)),
                        key=lambda a: (str(a.get("timestamp") or ""), a.get("step") or 0), reverse=True)
        return JSONResponse({"runs": payload, "samples": samples, "alerts": alerts[:samples_limit]})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
