"""The dashboard's web process: aiohttp pages, JSON APIs and server-sent events, on loopback.

Pages (vanilla JS and CSS from `dashboard/static/`, nothing from the internet):

=====================  =============================================================
``/``                  fabric view: nodes x NIC rails (and GPUs), leaf and spine switches
``/entity/<path>``     one NIC port, GPU, switch port, node or switch: charts, anomalies, actions
``/feed``              live anomalies and action decisions, with filters
``/jobs``              jobs, their ranks and step times, stragglers with probable cause
=====================  =============================================================

JSON under ``/api/``: ``fabric``, ``entity/<path>``, ``feed``, ``jobs``, ``status``, and
``events`` (server-sent events: every new anomaly and decision, filtered like ``/api/feed``).
Each SSE client has a bounded queue: a client that does not keep up loses its oldest
undelivered items (told with a ``dropped`` event), never the server's memory.

Bounded answers: every list an API answer carries is capped (with its total), and an
answer that would still exceed ``MAX_RESPONSE_BYTES`` is refused, counted and logged, so
no id a collector invents can make one answer huge (one GPU id ``gpu20000`` once made
``/api/fabric`` 27 MB). The ``Host`` header must name this dashboard
(`DashboardSettings.allowed_hosts`, its listen host and loopback names by default): a page
on another site that rebinds its DNS name to 127.0.0.1 gets 421, counted.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from fabricwatch import fabric_report
from fabricwatch.lograte import RateLimitedLogger, install_reconnect_log_limits

from .feed import FeedSettings, follow
from .state import FabricState
from .views import MAX_SWITCHES_SHOWN, FeedFilter, entity_view, fabric_view, feed_view, jobs_view

log = logging.getLogger("fabricwatch.dashboard")
_limited_log = RateLimitedLogger(log)

STATIC_DIR = Path(__file__).parent / "static"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
SSE_QUEUE_MAX = 256           # items per client before the oldest are dropped
SSE_MAX_CLIENTS = 64          # open event streams; more get 503 (each holds a queue and a task)
SSE_HEARTBEAT_S = 15.0        # a comment line keeps proxies and the browser's timer happy
FEED_RETRY_S = 5.0            # Kafka unreachable: try the feed again after this long
MAX_FEED_LIMIT = 1_000
MAX_FABRIC_LIMIT = 10_000     # rows asked for; the state caps a page by its cells too
MAX_JOBS_LIMIT = 500
MAX_RESPONSE_BYTES = 8 * 1024 * 1024

# The fabric report page is rebuilt (plots drawn) at most this often.
REPORT_CACHE_S = 10.0
_SECURITY_HEADERS = {
    # Everything is served from here: no CDN, no inline script.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class DashboardSettings:
    bootstrap: str
    host: str = "127.0.0.1"
    port: int = 8080
    topology_path: str = ""
    cluster: str = ""
    history_points: int = 120
    telemetry_lookback_s: float = 300.0
    events_lookback_s: float = 86_400.0
    stale_after_s: float = 30.0        # a node or switch silent this long is shown as "no data"
    allowed_hosts: tuple[str, ...] = ()  # Host header names besides the listen host and loopback (a proxy's)


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` on loopback (the dashboard has no authentication).

    >>> parse_listen("127.0.0.1:8080")
    ('127.0.0.1', 8080)
    >>> parse_listen("0.0.0.0:8080")
    Traceback (most recent call last):
    ...
    ValueError: --listen 0.0.0.0:8080: the dashboard has no authentication and listens on loopback only ...
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen {listen!r}: expected host:port, e.g. 127.0.0.1:8080")
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"--listen {listen}: the dashboard has no authentication and listens on loopback only "
                         "(127.0.0.1, localhost, ::1); reach it through an SSH tunnel or an authenticating proxy")
    return host.strip("[]"), int(port)


# ------------------------------------------------------------------------ SSE
class _Client:
    def __init__(self, flt: FeedFilter, queue_max: int) -> None:
        self.filter = flt
        self.queue: deque[dict] = deque(maxlen=queue_max)
        self.dropped = 0
        self.wake = asyncio.Event()


class SseHub:
    """Fans each new feed item out to the connected clients, each with a bounded queue."""

    def __init__(self, state: FabricState, queue_max: int = SSE_QUEUE_MAX, max_clients: int = SSE_MAX_CLIENTS) -> None:
        self.state = state
        self.queue_max = queue_max
        self.max_clients = max_clients
        self.clients: set[_Client] = set()
        self.closing = False
        state.listeners.append(self.publish)

    def publish(self, item: dict) -> None:
        for client in self.clients:
            if client.filter.matches(item, self.state):
                if len(client.queue) == client.queue.maxlen:
                    client.dropped += 1            # deque drops the oldest on append
                client.queue.append(item)
                client.wake.set()

    def close(self) -> None:
        self.closing = True
        for client in self.clients:
            client.wake.set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        flt = FeedFilter.parse(dict(request.query))
        if len(self.clients) >= self.max_clients:
            self.state.stats["sse_clients_refused"] += 1
            _limited_log.warning("dashboard: event stream refused, %d open already", len(self.clients))
            return web.Response(status=503, text=f"at most {self.max_clients} event streams\n")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        client = _Client(flt, self.queue_max)
        last_id = request.headers.get("Last-Event-ID", "")
        if last_id.isdigit():   # a reconnecting browser gets what it missed, as far as the feed reaches back
            missed = [i for i in self.state.feed if i["seq"] > int(last_id) and flt.matches(i, self.state)]
            client.queue.extend(missed[-self.queue_max:])
            if client.queue:
                client.wake.set()
        self.clients.add(client)
        try:
            await resp.write(b"retry: 3000\n: connected\n\n")
            while not self.closing:
                try:
                    await asyncio.wait_for(client.wake.wait(), SSE_HEARTBEAT_S)
                except asyncio.TimeoutError:
                    await resp.write(b": heartbeat\n\n")
                    continue
                client.wake.clear()
                if client.dropped:
                    await resp.write(f"event: dropped\ndata: {client.dropped}\n\n".encode())
                    client.dropped = 0
                while client.queue:
                    item = client.queue.popleft()
                    payload = json.dumps(item["data"], separators=(",", ":"))
                    await resp.write(f"id: {item['seq']}\nevent: {item['type']}\ndata: {payload}\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.clients.discard(client)
        return resp


# ------------------------------------------------------------------------ the app
def host_names(listen_host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> frozenset[str]:
    """Host header names (without port, lower case) this dashboard answers to.

    >>> sorted(host_names("127.0.0.1", ("dash.example",)))
    ['127.0.0.1', '::1', 'dash.example', 'localhost']
    """
    return frozenset(h.strip("[]").lower() for h in (*LOOPBACK_HOSTS, listen_host, *extra))


def host_of(header: str) -> str:
    """The name part of a Host header: ``[::1]:8080`` -> ``::1``, ``Dash.Example:80`` -> ``dash.example``.

    >>> host_of("[::1]:8080"), host_of("Dash.Example:80"), host_of("localhost")
    ('::1', 'dash.example', 'localhost')
    """
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _json(data, status: int = 200, stats=None) -> web.Response:
    body = json.dumps(data, separators=(",", ":"))
    if len(body) > MAX_RESPONSE_BYTES:      # the caps of `FabricState` should make this impossible
        if stats is not None:
            stats["responses_too_large"] += 1
        _limited_log.error("dashboard: an answer of %d bytes refused (limit %d)", len(body), MAX_RESPONSE_BYTES)
        body, status = json.dumps({"error": f"answer of {len(body)} bytes over the limit of {MAX_RESPONSE_BYTES}"}), 507
    return web.Response(text=body, status=status, content_type="application/json")


def _int_param(request: web.Request, name: str, default: int, maximum: int) -> int:
    raw = request.query.get(name, "")
    if not raw:
        return default
    if not raw.isdigit():
        raise web.HTTPBadRequest(text=json.dumps({"error": f"{name} must be a non-negative integer"}),
                                 content_type="application/json")
    return min(int(raw), maximum)


def build_app(state: FabricState, feed_status: dict | None = None,
              allowed_hosts: frozenset[str] = host_names()) -> web.Application:
    """The aiohttp application over `state` (the feed is started by `serve`, or by a test)."""
    hub = SseHub(state)
    feed_status = feed_status if feed_status is not None else {}

    @web.middleware
    async def known_host(request: web.Request, handler):
        # DNS rebinding: a page on evil.example that resolves to 127.0.0.1 must not read the API
        if host_of(request.headers.get("Host", "")) not in allowed_hosts:
            state.stats["bad_host_requests"] += 1
            _limited_log.warning("dashboard: request for Host %r refused (not one of %s)",
                                 request.headers.get("Host", "")[:100], sorted(allowed_hosts))
            return web.Response(status=421, text="unknown Host: this dashboard answers only to its own names\n")
        return await handler(request)

    @web.middleware
    async def bad_input(request: web.Request, handler):
        try:
            return await handler(request)
        except ValueError as exc:          # bad filter values and the like: a clear 400
            return _json({"error": str(exc)}, status=400)

    async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(_SECURITY_HEADERS)

    def page(name: str):
        async def handler(request: web.Request) -> web.FileResponse:
            return web.FileResponse(STATIC_DIR / name)
        return handler

    report_cache: dict = {}

    async def report(request: web.Request) -> web.Response:
        # the fabric report of what the feed read (rendering its plots takes a while: cached)
        now = time.monotonic()
        if now - report_cache.get("at", -REPORT_CACHE_S) >= REPORT_CACHE_S:
            built = fabric_report.build(state.fabric, [*state.resolved, *state.open.values()],
                                        title="Fabric report: what this dashboard has read")
            report_cache.update(at=now, page=built.html(css_href="/report.css"))
        return web.Response(text=report_cache["page"], content_type="text/html")

    async def report_css(request: web.Request) -> web.Response:
        return web.Response(text=fabric_report.REPORT_CSS, content_type="text/css")

    async def api_fabric(request: web.Request) -> web.Response:
        return _json(fabric_view(state, time.time_ns(),
                                 problems_only=request.query.get("problems", "") in ("1", "true", "on"),
                                 offset=_int_param(request, "offset", 0, 10**9),
                                 limit=_int_param(request, "limit", 512, MAX_FABRIC_LIMIT)), stats=state.stats)

    async def api_entity(request: web.Request) -> web.Response:
        path = request.match_info["path"]
        view = entity_view(state, path, time.time_ns())
        if view is None:
            return _json({"error": f"unknown entity {path[:200]!r}"}, status=404)
        return _json(view, stats=state.stats)

    async def api_feed(request: web.Request) -> web.Response:
        flt = FeedFilter.parse(dict(request.query))
        items = feed_view(state, flt, _int_param(request, "limit", 200, MAX_FEED_LIMIT))
        kinds = sorted({i["data"]["kind"] for i in state.feed if i["type"] == "anomaly"})
        return _json({"items": items, "kinds": kinds, "jobs": sorted(state.jobs),
                      "switches": sorted(state.switches)[:MAX_SWITCHES_SHOWN]}, stats=state.stats)

    async def api_jobs(request: web.Request) -> web.Response:
        return _json({"jobs": jobs_view(state, _int_param(request, "limit", MAX_JOBS_LIMIT, MAX_JOBS_LIMIT)),
                      "jobs_total": len(state.jobs)}, stats=state.stats)

    async def api_status(request: web.Request) -> web.Response:
        return _json({"stats": dict(state.stats), "open_anomalies": len(state.open), "decisions": len(state.decisions),
                      "nodes": len(state.nodes), "switches": len(state.switches), "jobs": len(state.jobs),
                      "series_bytes": state.memory_bytes(), "sse_clients": len(hub.clients),
                      "latest_event_unix_ms": state.latest_event_ns // 1_000_000, "cluster": state.cluster,
                      "feed": feed_status})

    async def on_shutdown(app: web.Application) -> None:
        hub.close()

    app = web.Application(middlewares=[known_host, bad_input])
    app.on_response_prepare.append(security_headers)
    app.router.add_get("/", page("index.html"))
    app.router.add_get("/feed", page("feed.html"))
    app.router.add_get("/jobs", page("jobs.html"))
    app.router.add_get("/report", report)
    app.router.add_get("/report.css", report_css)
    app.router.add_get("/entity/{path:.+}", page("entity.html"))
    app.router.add_get("/favicon.ico", page("favicon.svg"))
    app.router.add_get("/api/fabric", api_fabric)
    app.router.add_get("/api/entity/{path:.+}", api_entity)
    app.router.add_get("/api/feed", api_feed)
    app.router.add_get("/api/jobs", api_jobs)
    app.router.add_get("/api/status", api_status)
    app.router.add_get("/api/events", hub.handle)
    app.router.add_static("/static/", STATIC_DIR, append_version=False)
    app.on_shutdown.append(on_shutdown)
    return app


async def _supervise_feed(settings: DashboardSettings, state: FabricState, status: dict, stop: asyncio.Event) -> None:
    """Run the Kafka feed; if the broker is away, say so on /api/status and try again."""
    feed = FeedSettings(settings.bootstrap, settings.telemetry_lookback_s, settings.events_lookback_s)
    while not stop.is_set():
        try:
            status.update(state="connecting", error="")
            await follow(feed, state, stop, on_following=lambda: status.update(state="following"))
        except Exception as exc:  # the web view stays up while Kafka is away
            status.update(state="error", error=f"{type(exc).__name__}: {exc}"[:300])
            _limited_log.warning("dashboard feed: %s; retrying in %.0f s", status["error"], FEED_RETRY_S)
            try:
                await asyncio.wait_for(stop.wait(), FEED_RETRY_S)
            except asyncio.TimeoutError:
                pass
    status["state"] = "stopped"


async def serve(settings: DashboardSettings, on_ready=None) -> None:
    """Serve until SIGINT/SIGTERM."""
    from fabricwatch.topology_file import load_topology

    from .state import DashboardLimits

    install_reconnect_log_limits()
    topology = load_topology(settings.topology_path) if settings.topology_path else None
    state = FabricState(topology, cluster=settings.cluster,
                        limits=DashboardLimits(history_points=settings.history_points),
                        stale_after_s=settings.stale_after_s)
    status: dict = {"state": "starting", "error": "", "bootstrap": settings.bootstrap}
    app = build_app(state, status, host_names(settings.host, settings.allowed_hosts))
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else settings.port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = f"http://{settings.host if ':' not in settings.host else f'[{settings.host}]'}:{port}/"
    print(f"dashboard: {url}", flush=True)
    if on_ready:
        on_ready(url)
    feed = asyncio.create_task(_supervise_feed(settings, state, status, stop))
    try:
        await stop.wait()
    finally:
        stop.set()
        await feed
        await runner.cleanup()
