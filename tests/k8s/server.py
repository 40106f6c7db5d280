"""The HTTP face of the emulator (aiohttp): routing, content negotiation, discovery, OpenAPI,
lists, watches, and the Kubernetes error format. The semantics live in :mod:`.store`."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import yaml
from aiohttp import web

from . import errors, openapi, tables
from .errors import ApiError
from .resources import ResourceType
from .selection import field_selector, label_selector
from .store import Event, Store, Watcher, WriteOptions

log = logging.getLogger(__name__)
Obj = dict[str, Any]
Matcher = Callable[[Obj], bool]

SERVER_VERSION = {
    "major": "1",
    "minor": "36",
    "gitVersion": "v1.36.0-kelastic-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
PROTOBUF_HINT = (
    "the kelastic test emulator speaks JSON only; {what} in protobuf is not supported "
    "(kubectl create/helm install send protobuf: pipe `--dry-run=client -o yaml` into "
    "`kubectl apply -f -` instead)"
)
_PATCH_TYPES = {
    "application/json-patch+json": "json",
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
}

#: Marks a request whose access-log line was already written.
_LOGGED = web.RequestKey("logged", bool)


def _is_true(value: str | None) -> bool:
    return value in ("true", "1", "True")


class EmulatorServer:
    """An aiohttp application over a :class:`Store`; start it with :meth:`start`."""

    def __init__(self, store: Store | None = None, bookmark_interval: float = 1.0) -> None:
        self.store = store or Store()
        self.bookmark_interval = bookmark_interval
        self.requests: deque[tuple[str, str, int]] = deque(maxlen=2000)  # method, path?query, code
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._gc_pending = False
        self._streams = 0  # watch responses not yet finished
        self.store.schedule_gc = self._schedule_gc

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        return self.url

    async def stop(self) -> None:
        for watcher in list(self.store.watchers):
            watcher.queue.put_nowait(None)  # ends the stream
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.01)  # let the streams finish their chunked responses
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _schedule_gc(self) -> None:
        if not self._gc_pending:
            self._gc_pending = True
            asyncio.get_running_loop().call_soon(self._run_gc)

    def _run_gc(self) -> None:
        self._gc_pending = False
        self.store.collect_garbage()

    # --- entry point --------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            self._check_media(request)
            response = await self._dispatch(request)
        except ApiError as exc:
            response = web.json_response(exc.status(), status=exc.code)
        except Exception as exc:  # a bug in the emulator: say so, as a Status
            error = ApiError(500, "InternalError", f"emulator error: {exc!r}")
            response = web.json_response(error.status(), status=500)
            log.exception("emulator error on %s %s", request.method, request.path_qs, exc_info=exc)
        if not request.get(_LOGGED):
            self.requests.append((request.method, request.path_qs, response.status))
        return response

    @staticmethod
    def _check_media(request: web.Request) -> None:
        if "protobuf" in request.headers.get("Content-Type", ""):
            raise errors.unsupported_media_type(PROTOBUF_HINT.format(what="a request body"))
        accept = request.headers.get("Accept", "")
        if (
            accept
            and "protobuf" in accept
            and not any(m in accept for m in ("json", "*/*", "yaml", "text/plain"))
        ):
            raise errors.not_acceptable(PROTOBUF_HINT.format(what="a response"))

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.path.strip("/")
        parts = [p for p in path.split("/") if p]
        if request.method == "GET":
            simple = self._simple_get(path, parts, request)
            if simple is not None:
                return simple
        if len(parts) >= 3 and (parts[0], parts[1]) == ("api", "v1"):
            return await self._resource(request, "", "v1", parts[2:])
        if len(parts) >= 4 and parts[0] == "apis":
            return await self._resource(request, parts[1], parts[2], parts[3:])
        raise errors.no_such_resource()

    def _simple_get(
        self, path: str, parts: list[str], request: web.Request
    ) -> web.StreamResponse | None:
        store = self.store
        if path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path == "/version":
            return web.json_response(SERVER_VERSION)
        if path == "/":
            paths = ["/api", "/api/v1", "/apis", "/openapi/v3", "/version", "/healthz"]
            paths += [f"/apis/{g}/{v}" for g, vs in store.groups().items() for v in vs]
            return web.json_response({"paths": sorted(paths)})
        if path == "/openapi/v3":
            return web.json_response(openapi.index(store))
        if parts[:2] == ["openapi", "v3"] and len(parts) >= 4:
            if parts[2] == "api" and len(parts) == 4:
                return web.json_response(openapi.document(store, "", parts[3]))
            if (
                parts[2] == "apis"
                and len(parts) == 5
                and (parts[3], parts[4]) in {(g, v) for g, vs in store.groups().items() for v in vs}
            ):
                return web.json_response(openapi.document(store, parts[3], parts[4]))
            raise errors.no_such_resource()
        if path == "/api":
            host = request.host
            return web.json_response(
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": host}
                    ],
                }
            )
        if path == "/api/v1":
            return web.json_response(self._resource_list("", "v1"))
        if path == "/apis":
            return web.json_response(
                {
                    "kind": "APIGroupList",
                    "apiVersion": "v1",
                    "groups": [self._group(g, vs) for g, vs in store.groups().items()],
                }
            )
        if len(parts) == 2 and parts[0] == "apis":
            versions = store.groups().get(parts[1])
            if versions is None:
                raise errors.no_such_resource()
            return web.json_response(
                {"kind": "APIGroup", "apiVersion": "v1", **self._group(parts[1], versions)}
            )
        if len(parts) == 3 and parts[0] == "apis":
            if parts[2] not in store.groups().get(parts[1], []):
                raise errors.no_such_resource()
            return web.json_response(self._resource_list(parts[1], parts[2]))
        return None

    @staticmethod
    def _group(group: str, versions: list[str]) -> Obj:
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": entries, "preferredVersion": entries[0]}

    def _resource_list(self, group: str, version: str) -> Obj:
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": [e for rt in self.store.types_in(group, version) for e in rt.discovery()],
        }

    # --- resources ----------------------------------------------------------------------

    async def _resource(
        self, request: web.Request, group: str, version: str, rest: list[str]
    ) -> web.StreamResponse:
        watch = _is_true(request.query.get("watch"))
        if rest and rest[0] == "watch":
            watch, rest = True, rest[1:]
        namespace: str | None = None
        if (
            len(rest) >= 3
            and rest[0] == "namespaces"
            and not (len(rest) == 3 and rest[2] in ("status", "finalize"))
        ):
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise errors.no_such_resource()
        rt = self.store.type(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if (namespace is not None and not rt.namespaced) or (
            name is not None and rt.namespaced and namespace is None
        ):
            raise errors.no_such_resource()
        allowed_subs = {
            "status": rt.status,
            "finalize": rt.storage_key == "namespaces",
            "scale": rt.scale is not None,
            "log": rt.log,
        }
        if sub is not None and not allowed_subs.get(sub):
            raise errors.no_such_resource()
        if sub == "finalize":
            sub = None
        ns = namespace or ""
        method = request.method
        if method == "GET" and (watch or name is None):
            if watch:
                return await self._watch(request, rt, namespace, name)
            return self._list(request, rt, namespace)
        if method == "GET" and name is not None:
            if sub == "scale":
                return web.json_response(self.store.get_scale(rt, ns, name))
            if sub == "log":
                self.store.get(rt, ns, name)
                return web.Response(text=self.store.pod_logs.get((ns, name), ""))
            obj = self.store.get(rt, ns, name)
            if self._accepts(request) == "table":
                return web.json_response(
                    tables.table(rt, [obj], str(self.store.rv), self._include(request))
                )
            return web.json_response(obj)
        opts = WriteOptions(
            dry_run=request.query.get("dryRun") == "All",
            field_validation=request.query.get("fieldValidation", "Warn"),
        )
        if method == "POST" and name is None:
            created = self.store.create(rt, ns, await self._body(request), opts)
            return self._written(created, opts, 201)
        if method == "PUT" and name is not None:
            updated = self.store.replace(rt, ns, name, await self._body(request), sub, opts)
            return self._written(updated, opts)
        if method == "PATCH" and name is not None:
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
            patch_type = _PATCH_TYPES.get(content_type)
            if patch_type is None or (patch_type == "strategic" and rt.custom):
                accepted = [
                    t for t, k in _PATCH_TYPES.items() if not (rt.custom and k == "strategic")
                ]
                raise errors.unsupported_media_type(
                    f"the body of the request was in an unknown format - accepted media types "
                    f"include: {', '.join(accepted)}"
                )
            if patch_type == "apply" and not request.query.get("fieldManager"):
                raise errors.bad_request("PATCH requests of type apply must supply a fieldManager")
            patched = self.store.patch(
                rt, ns, name, patch_type, await self._body(request), sub, opts
            )
            return self._written(patched, opts)
        if method == "DELETE" and name is not None and sub is None:
            options = await self._body(request, default={})
            if "propagationPolicy" in request.query:
                options["propagationPolicy"] = request.query["propagationPolicy"]
            return web.json_response(self.store.delete(rt, ns, name, options, opts.dry_run))
        if method == "DELETE" and name is None:
            options = await self._body(request, default={})
            deleted = [
                self.store.delete(
                    rt,
                    o["metadata"].get("namespace", ""),
                    o["metadata"]["name"],
                    options,
                    opts.dry_run,
                )
                for o in self._selected(request, rt, namespace)
            ]
            return web.json_response(
                {
                    "kind": rt.list_kind,
                    "apiVersion": rt.api_version,
                    "metadata": {},
                    "items": deleted,
                }
            )
        raise errors.method_not_allowed(
            f"the server does not allow this method on the requested resource: {method}"
        )

    @staticmethod
    def _written(obj: Obj, opts: WriteOptions, code: int = 200) -> web.Response:
        response = web.json_response(obj, status=code)
        for warning in opts.warnings:
            escaped = warning.replace("\\", "\\\\").replace('"', '\\"')
            response.headers.add("Warning", f'299 - "{escaped}"')
        return response

    @staticmethod
    async def _body(request: web.Request, default: Any = None) -> Any:
        raw = await request.read()
        if not raw.strip():
            if default is not None:
                return default
            raise errors.bad_request("the request has no body")
        content_type = request.headers.get("Content-Type", "")
        try:
            if "yaml" in content_type:
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise errors.bad_request(f"the request body is not valid JSON/YAML: {exc}") from exc

    @staticmethod
    def _accepts(request: web.Request) -> str:
        accept = request.headers.get("Accept", "")
        if "as=Table" in accept:
            return "table"
        if "as=PartialObjectMetadata" in accept:
            return "partial"
        return "json"

    @staticmethod
    def _include(request: web.Request) -> str:
        return request.query.get("includeObject", "Metadata")

    @staticmethod
    def _matcher(request: web.Request, name: str | None = None) -> Matcher:
        labels = label_selector(request.query.get("labelSelector"))
        fields = field_selector(request.query.get("fieldSelector"))
        if name is None:
            return lambda obj: labels(obj) and fields(obj)
        return lambda obj: labels(obj) and fields(obj) and obj["metadata"]["name"] == name

    def _selected(self, request: web.Request, rt: ResourceType, namespace: str | None) -> list[Obj]:
        matches = self._matcher(request)
        return [obj for obj in self.store.list_objects(rt, namespace) if matches(obj)]

    def _list(self, request: web.Request, rt: ResourceType, namespace: str | None) -> web.Response:
        items = self._selected(request, rt, namespace)
        meta: Obj = {"resourceVersion": str(self.store.rv)}
        token = request.query.get("continue")
        if token:
            try:
                after = tuple(json.loads(base64.urlsafe_b64decode(token.encode())))
            except ValueError as exc:
                raise errors.bad_request(f"invalid continue token: {exc}") from exc
            items = [
                o
                for o in items
                if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > after
            ]
        limit = int(request.query.get("limit") or 0)
        if limit and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            last = items[-1]["metadata"]
            cursor = json.dumps([last.get("namespace", ""), last["name"]]).encode()
            meta["continue"] = base64.urlsafe_b64encode(cursor).decode()
            meta["remainingItemCount"] = len(rest)
        mode = self._accepts(request)
        if mode == "table":
            return web.json_response(
                tables.table(rt, items, meta["resourceVersion"], self._include(request))
            )
        if mode == "partial":
            return web.json_response(
                {
                    "kind": "PartialObjectMetadataList",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": meta,
                    "items": [_partial(o) for o in items],
                }
            )
        return web.json_response(
            {"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta, "items": items}
        )

    # --- watch --------------------------------------------------------------------------

    async def _watch(
        self, request: web.Request, rt: ResourceType, namespace: str | None, name: str | None
    ) -> web.StreamResponse:
        query = request.query
        matches = self._matcher(request, name)
        send_initial = _is_true(query.get("sendInitialEvents"))
        bookmarks = _is_true(query.get("allowWatchBookmarks"))
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        mode = self._accepts(request)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            initial, watcher = self.store.watch(
                rt, namespace, None if send_initial else query.get("resourceVersion")
            )
        except ApiError as exc:
            if exc.code != 410:
                raise
            await response.prepare(request)
            await _send(response, {"type": "ERROR", "object": exc.status()})
            return response
        await response.prepare(request)
        self.requests.append((request.method, request.path_qs, response.status))
        request[_LOGGED] = True
        sent_columns = False
        self._streams += 1
        try:
            for event in initial:
                sent_columns = await self._send_event(
                    response, rt, event, matches, mode, sent_columns, request
                )
            if send_initial:
                marker = {"k8s.io/initial-events-end": "true"}
                await _send(response, self._bookmark(rt, marker))
            await self._stream(
                response, rt, watcher, matches, mode, sent_columns, request, timeout, bookmarks
            )
            self.store.unwatch(watcher)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            log.debug("watch stream ended: %r", exc)
        finally:
            self.store.unwatch(watcher)
            self._streams -= 1
        return response

    async def _stream(
        self,
        response: web.StreamResponse,
        rt: ResourceType,
        watcher: Watcher,
        matches: Matcher,
        mode: str,
        sent_columns: bool,
        request: web.Request,
        timeout: float | None,
        bookmarks: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            wait = self.bookmark_interval if bookmarks else None
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    return
                wait = left if wait is None else min(wait, left)
            try:
                event = await asyncio.wait_for(watcher.queue.get(), wait)
            except asyncio.TimeoutError:
                if bookmarks:
                    await _send(response, self._bookmark(rt))
                continue
            if event is None:  # the server is stopping
                return
            sent_columns = await self._send_event(
                response, rt, event, matches, mode, sent_columns, request
            )

    async def _send_event(
        self,
        response: web.StreamResponse,
        rt: ResourceType,
        event: Event,
        matches: Matcher,
        mode: str,
        sent_columns: bool,
        request: web.Request,
    ) -> bool:
        kind = _event_type(event, matches)
        if kind is None:
            return sent_columns
        obj = self.store.present(rt, event.obj)
        if mode == "table":
            body = tables.table(rt, [obj], str(event.rv), self._include(request), not sent_columns)
            await _send(response, {"type": kind, "object": body})
            return True
        await _send(response, {"type": kind, "object": _partial(obj) if mode == "partial" else obj})
        return sent_columns

    def _bookmark(self, rt: ResourceType, annotations: dict[str, str] | None = None) -> Obj:
        meta: Obj = {"resourceVersion": str(self.store.rv)}
        if annotations:
            meta["annotations"] = annotations
        return {
            "type": "BOOKMARK",
            "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta},
        }


def _event_type(event: Event, matches: Matcher) -> str | None:
    """The event a selector-filtered watch sees: objects entering the selection are ADDED,
    objects leaving it are DELETED, as with the real server."""
    new_ok = matches(event.obj)
    old_ok = event.old is not None and matches(event.old)
    if event.type == "ADDED":
        return "ADDED" if new_ok else None
    if event.type == "DELETED":
        return "DELETED" if new_ok or old_ok else None
    if new_ok:
        return "MODIFIED" if old_ok else "ADDED"
    return "DELETED" if old_ok else None


def _partial(obj: Obj) -> Obj:
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj["metadata"],
    }


async def _send(response: web.StreamResponse, event: Obj) -> None:
    await response.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")
