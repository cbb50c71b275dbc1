"""The worker's HTTP API (aiohttp) and its one HTML page.

GET /healthz, GET /jobs, GET /jobs/{id} (state, counts, ETA), GET /jobs/{id}/export
(the export JSON with `partial` set while not every case has a verdict), POST /jobs
(submit, validated as `rescue submit` does), POST /jobs/{id}/drain (as `rescue cancel`),
GET / (the jobs with live counts), and a finished job's report under
/jobs/{id}/study/ (report.html and its files). With an API key every route but /healthz asks for it, as
`Authorization: Bearer KEY`, `X-API-Key: KEY` or `?key=KEY` (the page passes its own on).
"""

from __future__ import annotations

import asyncio
import hmac
import html
import json
import time
from pathlib import Path

from aiohttp import web

from rescue.core.config import ConfigError
from rescue.core.manifest import ManifestError
from rescue.service.queue import QueueError, cancel_job, config_problems, find_job, job_view, list_jobs, submit_job
from rescue.study import layout

QUEUE = web.AppKey("queue", Path)
API_KEY = web.AppKey("api_key", str)
WORKER = web.AppKey("worker", object)

# The largest manifest a POST may carry (the manifest reader's own limit is larger; a queue need not be).
MAX_BODY = 16 * 1024 * 1024


def _authorized(request: web.Request, key: str) -> bool:
    given = request.headers.get("X-API-Key") or request.query.get("key") or ""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        given = auth[len("Bearer "):]
    return hmac.compare_digest(given.encode(), key.encode())


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app[API_KEY]
    if key and request.path != "/healthz" and not _authorized(request, key):
        return web.json_response({"error": "an API key is required"}, status=401)
    return await handler(request)


def _job_or_404(request: web.Request):
    try:
        return find_job(request.app[QUEUE], request.match_info["job_id"])
    except QueueError as exc:
        raise web.HTTPNotFound(text=json.dumps({"error": str(exc)}), content_type="application/json") from None


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
    return web.json_response({"jobs": await asyncio.to_thread(_views, request.app[QUEUE])})


async def job(request: web.Request) -> web.Response:
    found = _job_or_404(request)
    view = await asyncio.to_thread(job_view, found)
    return web.json_response(view.model_dump(mode="json"))


def _export(study: Path) -> dict:
    from rescue.read.export import export_study

    export = export_study(study)
    partial = not all(c.complete for c in export.coverage.values() if c.n_manifest)
    return {"partial": partial, "export": export.model_dump(mode="json")}


async def job_export(request: web.Request) -> web.Response:
    found = _job_or_404(request)
    if not layout.StudyLayout.of(found.layout.study).is_study():
        return web.json_response({"error": f"{found.spec.job_id} has not started: no study yet"}, status=409)
    return web.json_response(await asyncio.to_thread(_export, found.layout.study))


async def submit(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"problems": ["the body is not JSON"]}, status=400)
    if not isinstance(body, dict) or not isinstance(body.get("manifest"), str):
        return web.json_response({"problems": ['give {"manifest": "<JSON lines>", "config": {...}, "name": "..."}']},
                                 status=400)
    name = body.get("name")
    try:
        config = config_problems(body.get("config") or {})
        spec = await asyncio.to_thread(
            submit_job, request.app[QUEUE], body["manifest"].encode(), name or "posted", config, name,
        )
    except ManifestError as exc:
        return web.json_response({"problems": list(exc.problems)}, status=400)
    except ConfigError as exc:
        return web.json_response({"problems": [str(exc)]}, status=400)
    return web.json_response(spec.model_dump(mode="json"), status=201)


async def drain(request: web.Request) -> web.Response:
    found = _job_or_404(request)
    message = await asyncio.to_thread(cancel_job, request.app[QUEUE], found.spec.job_id)
    return web.json_response({"job_id": found.spec.job_id, "message": message})


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
const key = new URLSearchParams(location.search).get("key");
const q = key ? "?key=" + encodeURIComponent(key) : "";
function cell(tr, text) {{ const td = document.createElement("td"); td.textContent = text; tr.appendChild(td); return td; }}
async function refresh() {{
  try {{
    const r = await fetch("/jobs" + q);
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
      if (j.report) {{
        const a = document.createElement("a");
        a.href = "/jobs/" + encodeURIComponent(j.job_id) + "/study/{report}" + q; a.textContent = "report";
        td.appendChild(a);
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


def _row(view: dict, key_query: str) -> str:
    e = html.escape
    labels = " ".join(f"{k}={v}" for k, v in view["labels"].items())
    eta = "" if view["eta_s"] is None else f"{round(view['eta_s'])} s"
    link = ""
    if view["report"]:
        link = f'<a href="/jobs/{e(view["job_id"])}/study/{layout.REPORT}{e(key_query)}">report</a>'
    return (f'<tr data-job="{e(view["job_id"])}" data-state="{e(view["state"])}"><td>{e(view["job_id"])}</td>'
            f'<td>{e(view["name"])}</td><td>{e(view["state"])}</td><td>{view["done"]} / {view["cases"]}</td>'
            f"<td>{e(labels)}</td><td>{eta}</td><td>{link}</td></tr>")


async def page(request: web.Request) -> web.Response:
    key = request.query.get("key")
    key_query = f"?key={key}" if key else ""
    views = await asyncio.to_thread(_views, request.app[QUEUE])
    text = PAGE.format(rows="".join(_row(v, key_query) for v in views), report=layout.REPORT,
                       updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return web.Response(text=text, content_type="text/html")


def make_app(queue: Path, api_key: str | None, worker: object | None = None) -> web.Application:
    """The API application over a queue folder; `worker` (a service.worker.Worker) answers /healthz's running job."""
    app = web.Application(middlewares=[_auth], client_max_size=MAX_BODY)
    app[QUEUE] = Path(queue)
    app[API_KEY] = api_key or ""
    app[WORKER] = worker
    app.add_routes([
        web.get("/", page),
        web.get("/healthz", healthz),
        web.get("/jobs", jobs),
        web.post("/jobs", submit),
        web.get("/jobs/{job_id}", job),
        web.get("/jobs/{job_id}/export", job_export),
        web.post("/jobs/{job_id}/drain", drain),
        web.get("/jobs/{job_id}/study/{tail:.+}", study_file),
    ])
    return app
