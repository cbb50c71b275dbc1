"""The worker's HTTP API (aiohttp) and its one HTML page.

GET /healthz, GET /jobs, GET /jobs/{id} (state, counts, ETA), GET /jobs/{id}/export
(the export JSON with `partial` set while not every case has a verdict), GET
/jobs/{id}/log (the tail of the job's log), POST /jobs (submit, validated as
`rescue submit` does and against the service's choices), POST /jobs/{id}/cancel
(as `rescue cancel`; /drain is its older name), GET / (the jobs with live counts),
and a finished job's report under /jobs/{id}/study/ (report.html and its files).

What a caller cannot make it do: with an API key, every route but /healthz and
the page's empty shell asks for it as `Authorization: Bearer KEY`, never in the
URL (a URL ends up in logs, histories and Referer headers); a POST must say
`Content-Type: application/json`, which a cross-site form cannot send without
the browser asking first (and nothing here answers that); without a key (on
loopback only) a request must name a loopback host, so a page of another site
that rebinds its name to 127.0.0.1 is refused; a body is bounded in size,
nesting and the time it takes to arrive (BODY_TIMEOUT_S: a client that claims
more than it sends is answered 408 and cut off); and no answer holds an absolute path of the worker's host (the queue's
paths are relative to it, any other is cut to its last part).
"""

from __future__ import annotations

import asyncio
import hmac
import html
import ipaddress
import json
import re
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rescue.core.configuration.config_files import ConfigError
from rescue.core.manifest import ManifestError, RepeatedKey, unique_keys
from rescue.service.settings import ServiceConfig
from rescue.service.job_request import job_request
from rescue.service.queue import (
    MAX_NAME_CHARS,
    QueueError,
    cancel_job,
    find_job,
    job_view,
    list_jobs,
    submit_job,
)
from rescue.study import layout

QUEUE = web.AppKey("queue", Path)
API_KEY = web.AppKey("api_key", str)
WORKER = web.AppKey("worker", object)
SERVICE = web.AppKey("service", ServiceConfig)
BODY_TIMEOUT = web.AppKey("body_timeout", float)

# The largest body a POST may carry (the manifest reader's own limit is larger; a queue need not be).
MAX_BODY = 16 * 1024 * 1024
# Seconds a POST's body may take to arrive whole (a client that claims more than it sends is cut off).
BODY_TIMEOUT_S = 30.0
# The deepest nesting of a POST's JSON (a job's configuration needs five levels).
MAX_DEPTH = 32
# The tail of a job's log an answer carries at most.
MAX_LOG_BYTES = 256 * 1024
# Routes a caller without the key may ask: a health probe, and the page's shell (it holds no job).
OPEN_ROUTES = ("/healthz", "/")


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def _authorized(request: web.Request, key: str) -> bool:
    # The header only: `?key=` and X-API-Key are not read.
    auth = request.headers.get("Authorization", "")
    given = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
    return hmac.compare_digest(given.encode(), key.encode())


def is_loopback(host: str) -> bool:
    """Whether a bind address (or a request's host) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_is_loopback(request: web.Request) -> bool:
    host = request.host
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return is_loopback(host)


@web.middleware
async def _guard(request: web.Request, handler):
    """Host (keyless), key, then content type: refused before any handler reads the request."""
    key = request.app[API_KEY]
    if not key and not _host_is_loopback(request):
        return _error(403, "this service answers requests for a loopback host only (127.0.0.1, localhost, ::1)")
    if key and request.path not in OPEN_ROUTES and not _authorized(request, key):
        return _error(401, "an API key is required, as the header Authorization: Bearer KEY")
    if request.method == "POST" and request.content_type != "application/json":
        return _error(415, "a POST must carry Content-Type: application/json")
    return await handler(request)


# An absolute path: a slash not inside a word, a URL, a relative path or a markup tag (`</script>`).
_ABS_PATH = re.compile(r"(?<![\w.~:/<-])/[^\s'\"<>|;,()\[\]{}]+")


def _scrub(text: str, queue: Path) -> str:
    """Text without absolute host paths: the queue's own relative to it, any other cut to `…/last`."""
    for root in dict.fromkeys((str(queue.resolve()), str(queue.absolute()))):
        text = text.replace(root + "/", "").replace(root, ".")
    return _ABS_PATH.sub(lambda m: "…/" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def _scrubbed(value: Any, queue: Path) -> Any:
    if isinstance(value, str):
        return _scrub(value, queue)
    if isinstance(value, dict):
        return {k: _scrubbed(v, queue) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrubbed(v, queue) for v in value]
    return value


def _answer(request: web.Request, data: Any, status: int = 200) -> web.Response:
    return web.json_response(_scrubbed(data, request.app[QUEUE]), status=status)


def _job_or_404(request: web.Request):
    try:
        return find_job(request.app[QUEUE], request.match_info["job_id"])
    except QueueError as exc:
        raise web.HTTPNotFound(text=json.dumps({"error": _scrub(str(exc), request.app[QUEUE])}),
                               content_type="application/json") from None


def _parse(raw: bytes) -> Any:
    """A POST's JSON, bounded in nesting, each key of an object once and valid text throughout; ValueError says
    why not."""
    try:
        body = json.loads(raw, object_pairs_hook=unique_keys) if raw.strip() else {}
    except RepeatedKey as exc:
        raise ValueError(f"the body gives the key {exc.args[0]!r} twice in one object") from None
    except RecursionError:
        raise ValueError(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the body is not JSON") from None
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"the body nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
            stack.extend((k, depth) for k in value)
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("the body holds text that is not valid Unicode (a lone surrogate)") from None
    return body


async def _body(request: web.Request) -> Any:
    """The POST's JSON; 413 past MAX_BODY (aiohttp), 408 when it does not arrive whole within the body timeout
    (a Content-Length that claims more than is sent holds no connection), 400 when it is not bounded JSON."""
    try:
        raw = await asyncio.wait_for(request.read(), request.app[BODY_TIMEOUT])
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(
            text=json.dumps({"problems": [f"the body did not arrive whole within {request.app[BODY_TIMEOUT]:g} s"]}),
            content_type="application/json", headers={"Connection": "close"}) from None
    try:
        return await asyncio.to_thread(_parse, raw)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=json.dumps({"problems": [str(exc)]}), content_type="application/json") from None


class Submission(BaseModel):
    """The body of POST /jobs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    manifest: str
    """The manifest, as JSON lines."""
    config: dict[str, Any] | None = None
    """The job's settings: job-settable keys, and its choices (`vlm.endpoint`, `policy.name`); None: none."""
    name: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    """A name for people."""


async def healthz(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    current = getattr(worker, "current", None)
    return web.json_response({
        "ok": True,
        "time": time.time(),
        "running": current.spec.job_id if current is not None else None,
        "draining": bool(worker is not None and worker.stopping.is_set()),
    })


def _views(queue: Path) -> list[dict]:
    return [job_view(job).model_dump(mode="json") for job in list_jobs(queue)]


async def jobs(request: web.Request) -> web.Response:
    return _answer(request, {"jobs": await asyncio.to_thread(_views, request.app[QUEUE])})


async def job(request: web.Request) -> web.Response:
    found = _job_or_404(request)
    view = await asyncio.to_thread(job_view, found)
    return _answer(request, view.model_dump(mode="json"))


def _export(study: Path) -> dict:
    from rescue.read.export import export_study

    export = export_study(study)
    partial = not all(c.complete for c in export.coverage.values() if c.n_manifest)
    return {"partial": partial, "export": export.model_dump(mode="json")}


async def job_export(request: web.Request) -> web.Response:
    found = _job_or_404(request)
    if not layout.StudyLayout.of(found.layout.study).is_study():
        return _error(409, f"{found.spec.job_id} has not started: no study yet")
    data = await asyncio.to_thread(_export, found.layout.study)
    return _answer(request, await asyncio.to_thread(_scrubbed, data, request.app[QUEUE]))


def _log_tail(path: Path, limit: int) -> tuple[str, int]:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except FileNotFoundError:
        return "", 0
    text = data.decode("utf-8", errors="replace")
    if size > limit:
        text = text.split("\n", 1)[-1]  # from the first whole line
    return text, size


async def job_log(request: web.Request) -> web.Response:
    """The tail of a job's log (at most MAX_LOG_BYTES, or `?bytes=N` fewer), from its first whole line."""
    found = _job_or_404(request)
    try:
        limit = int(request.query.get("bytes", MAX_LOG_BYTES))
    except ValueError:
        return _error(400, "bytes: a whole number")
    limit = max(1, min(limit, MAX_LOG_BYTES))
    text, size = await asyncio.to_thread(_log_tail, found.layout.log, limit)
    return _answer(request, {"job_id": found.spec.job_id, "state": found.state.state, "size": size,
                             "truncated": size > limit, "log": text})


async def submit(request: web.Request) -> web.Response:
    body = await _body(request)
    try:
        sub = Submission.model_validate(body)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: "
                    f"{'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}" for e in exc.errors()]
        return _answer(request, {"problems": problems + ['give {"manifest": "<JSON lines>", "config": {...}, "name": "..."}']},
                       400)
    try:
        req = job_request(sub.config or {})
        spec = await asyncio.to_thread(
            submit_job, request.app[QUEUE], sub.manifest.encode(), sub.name or "posted", req, sub.name,
            request.app[SERVICE],
        )
    except ManifestError as exc:
        return _answer(request, {"problems": list(exc.problems)}, 400)
    except ConfigError as exc:
        return _answer(request, {"problems": [str(exc)]}, 400)
    return _answer(request, spec.model_dump(mode="json"), 201)


async def cancel(request: web.Request) -> web.Response:
    """As `rescue cancel`: a queued job is removed, a running one drains and ends stopped."""
    found = _job_or_404(request)
    try:
        message = await asyncio.to_thread(cancel_job, request.app[QUEUE], found.spec.job_id)
    except QueueError as exc:
        return _error(404, _scrub(str(exc), request.app[QUEUE]))
    return _answer(request, {"job_id": found.spec.job_id, "message": message})


async def study_file(request: web.Request) -> web.StreamResponse:
    """A finished job's report and its assets folder, nothing else of the study."""
    found = _job_or_404(request)
    study = found.layout.study.resolve()
    report = study / layout.REPORT
    assets = layout.report_files(report)
    target = (study / request.match_info["tail"]).resolve()
    if target != report and not target.is_relative_to(assets):
        raise web.HTTPNotFound()
    if not target.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(target)


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>rescue queue</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}</style></head>
<body><h1>rescue queue</h1>
<p>Updated <span id="updated" data-live="0">{updated}</span></p>
<table><thead><tr><th>job</th><th>name</th><th>state</th><th>cases done</th><th>labels</th><th>ETA</th><th>report</th>
</tr></thead><tbody id="jobs">{rows}</tbody></table>
<script>
// With an API key, open this page as /#key=KEY: a fragment never leaves the browser; the key goes in a header.
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const headers = key ? {{"Authorization": "Bearer " + key}} : {{}};
function cell(tr, text) {{ const td = document.createElement("td"); td.textContent = text; tr.appendChild(td); return td; }}
async function refresh() {{
  try {{
    const r = await fetch("/jobs", {{headers}});
    if (!r.ok) return;
    const data = await r.json();
    const body = document.getElementById("jobs");
    body.replaceChildren();
    for (const j of data.jobs) {{
      const tr = document.createElement("tr");
      tr.dataset.job = j.job_id; tr.dataset.state = j.state;
      cell(tr, j.job_id); cell(tr, j.name); cell(tr, j.state);
      cell(tr, j.done + " / " + j.cases);
      cell(tr, Object.entries(j.labels).map(([k, v]) => k + "=" + v).join(" "));
      cell(tr, j.eta_s == null ? "" : Math.round(j.eta_s) + " s");
      const td = cell(tr, "");
      if (j.report && !key) {{
        const a = document.createElement("a");
        a.href = "/jobs/" + encodeURIComponent(j.job_id) + "/study/{report}"; a.textContent = "report";
        td.appendChild(a);
      }} else if (j.report) {{
        td.textContent = "ready (GET with the key)";
      }}
      body.appendChild(tr);
    }}
    const u = document.getElementById("updated");
    u.textContent = new Date().toISOString(); u.dataset.live = "1";
  }} catch (e) {{}}
}}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""


def _row(view: dict) -> str:
    e = html.escape
    labels = " ".join(f"{k}={v}" for k, v in view["labels"].items())
    eta = "" if view["eta_s"] is None else f"{round(view['eta_s'])} s"
    link = f'<a href="/jobs/{e(view["job_id"])}/study/{layout.REPORT}">report</a>' if view["report"] else ""
    return (f'<tr data-job="{e(view["job_id"])}" data-state="{e(view["state"])}"><td>{e(view["job_id"])}</td>'
            f'<td>{e(view["name"])}</td><td>{e(view["state"])}</td><td>{view["done"]} / {view["cases"]}</td>'
            f"<td>{e(labels)}</td><td>{eta}</td><td>{link}</td></tr>")


async def page(request: web.Request) -> web.Response:
    """The jobs page. With an API key it is an empty shell that anyone may load: its script asks for the rows with the key."""
    views = [] if request.app[API_KEY] else await asyncio.to_thread(_views, request.app[QUEUE])
    text = PAGE.format(rows="".join(_row(v) for v in views), report=layout.REPORT,
                       updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return web.Response(text=text, content_type="text/html")


def make_app(queue: Path, api_key: str | None, worker: object | None = None,
             service: ServiceConfig | None = None, body_timeout_s: float = BODY_TIMEOUT_S) -> web.Application:
    """The API application over a queue folder; `worker` (a service.worker.Worker) answers /healthz's running job,
    `service` holds the choices a submitted job may make (default: the embedded ones); a POST's body must arrive
    whole within `body_timeout_s`."""
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY)
    app[BODY_TIMEOUT] = body_timeout_s
    app[QUEUE] = Path(queue)
    app[API_KEY] = api_key or ""
    app[WORKER] = worker
    app[SERVICE] = service or ServiceConfig()
    app.add_routes([
        web.get("/", page),
        web.get("/healthz", healthz),
        web.get("/jobs", jobs),
        web.post("/jobs", submit),
        web.get("/jobs/{job_id}", job),
        web.get("/jobs/{job_id}/export", job_export),
        web.get("/jobs/{job_id}/log", job_log),
        web.post("/jobs/{job_id}/cancel", cancel),
        web.post("/jobs/{job_id}/drain", cancel),  # the older name of cancel
        web.get("/jobs/{job_id}/study/{tail:.+}", study_file),
    ])
    return app
