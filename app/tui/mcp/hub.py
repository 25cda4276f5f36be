"""MCP servers' connections, on a thread of their own: one asyncio loop there runs every server's client (the `mcp`
SDK), so nothing the SDK does (starting a process, pydantic on a large result, a slow handshake) waits on, or
stalls, the UI. Each server is one task that owns its `Client` from connect to close (anyio's scopes are entered
and left by the same task) and serves the calls queued to it one at a time.

The UI thread reads snapshots (`states()`), is told when they change (`on_change`, called on the hub's thread: post
a message, never wait on the UI), and gets each call's `ToolResult` as a concurrent future. A server that cannot
start, or stops, is its state's one-line `error`; a call never raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.toolcalls.tools import NAME, ToolSpecError, function_spec
from app.tui.mcp.config import ServerSpec

CONNECT_TIMEOUT_S = 60.0
MAX_RESULT_CHARS = 4000  # what one result may take of the model's context
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerState:
    name: str
    spec: ServerSpec
    status: str = "starting"  # starting | connected | failed | stopped
    tools: tuple[dict[str, Any], ...] = ()  # function specs ({"name", "description", "parameters"}) as offered
    skipped: tuple[str, ...] = ()  # one line per tool that cannot be offered
    error: str | None = None
    log: Path | None = None  # a stdio server's stderr


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model is told
    status: str  # done | error | timeout | gone (the server stopped)


@dataclass
class _Job:
    tool: str
    arguments: dict[str, Any]
    timeout_s: float
    future: concurrent.futures.Future[ToolResult]


@dataclass
class _Server:
    state: ServerState
    generation: int
    queue: asyncio.Queue[_Job | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    current: _Job | None = None  # the call in flight


class _Gone(Exception):
    """The connection to the server ended during a call (`job`: answered once the server's state says so)."""

    def __init__(self, job: _Job):
        super().__init__("the connection closed")
        self.job = job


class MCPHub:
    def __init__(self, log_dir: Path, on_change: Callable[[], None] = lambda: None):
        self.log_dir = log_dir
        self.on_change = on_change
        self._lock = threading.Lock()
        self._states: dict[str, ServerState] = {}
        self._servers: dict[str, _Server] = {}  # the hub loop's own
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._generation = 0  # bumped by each start(): an older server's news is void

    # ---- any thread ------------------------------------------------------------------------------------

    def states(self) -> list[ServerState]:
        with self._lock:
            return list(self._states.values())

    def start(self, specs: list[ServerSpec]) -> concurrent.futures.Future[None]:
        """Stops the servers running, then starts `specs` (done once every old one has closed)."""
        with self._lock:
            self._generation += 1
            self._states = {s.name: ServerState(s.name, s, log=self._log_path(s)) for s in specs}
            generation = self._generation
        self.on_change()
        return asyncio.run_coroutine_threadsafe(self._restart(specs, generation), self._ensure_loop())

    def call(self, server: str, tool: str, arguments: dict[str, Any], timeout_s: float
             ) -> concurrent.futures.Future[ToolResult]:
        """Runs the server's tool; the result (never an exception) when it answers, fails, times out or stops."""
        future: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
        job = _Job(tool, arguments, timeout_s, future)
        self._ensure_loop().call_soon_threadsafe(self._enqueue, server, job)
        return future

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops every server (their processes end) and the hub's thread."""
        loop = self._loop
        if loop is None:
            return
        try:
            with self._lock:
                self._generation += 1
                generation = self._generation
            asyncio.run_coroutine_threadsafe(self._restart([], generation), loop).result(timeout)
        except Exception:  # noqa: BLE001 - closing is best effort; the thread is a daemon
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._loop_thread is not None:
            self._loop_thread.join(timeout)
        self._loop = None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=loop.run_forever, name="mcp-hub", daemon=True)
            self._loop_thread.start()
            self._loop = loop
        return self._loop

    def _log_path(self, spec: ServerSpec) -> Path | None:
        if spec.transport != "stdio":
            return None
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name)
        return self.log_dir / f"{safe}.log"

    def _set(self, srv: _Server, **changes: Any) -> None:
        with self._lock:
            state = self._states.get(srv.state.name)
            if state is None or srv.generation != self._generation:
                return
            self._states[srv.state.name] = dataclasses.replace(state, **changes)
        self.on_change()

    # ---- the hub's loop --------------------------------------------------------------------------------

    async def _restart(self, specs: list[ServerSpec], generation: int) -> None:
        old, self._servers = self._servers, {}
        for srv in old.values():
            srv.queue.put_nowait(None)
        tasks = [srv.task for srv in old.values() if srv.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
            for task in pending:  # a server stuck in its handshake or a call
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=CLOSE_TIMEOUT_S)
        for spec in specs:
            srv = _Server(ServerState(spec.name, spec, log=self._log_path(spec)), generation)
            self._servers[spec.name] = srv
            srv.task = asyncio.create_task(self._run(srv))

    def _enqueue(self, server: str, job: _Job) -> None:
        srv = self._servers.get(server)
        if srv is None or srv.task is None or srv.task.done():
            state = self.states_by_name().get(server)
            why = state.error if state is not None and state.error else "it is not running"
            _settle(job.future, ToolResult(f"Error: the MCP server '{server}' is not available ({why}).", "gone"))
            return
        srv.queue.put_nowait(job)

    def states_by_name(self) -> dict[str, ServerState]:
        with self._lock:
            return dict(self._states)

    async def _run(self, srv: _Server) -> None:
        spec, name = srv.state.spec, srv.state.name
        log_at = _size(srv.state.log)
        connected = False
        status, error, gone = "stopped", None, None
        try:
            async with AsyncExitStack() as stack:
                try:
                    async with asyncio.timeout(CONNECT_TIMEOUT_S):
                        client = await self._connect(spec, srv.state.log, stack)
                        listing = await _list_tools(client)
                except TimeoutError:
                    raise RuntimeError(f"no answer to the MCP handshake within {CONNECT_TIMEOUT_S:g} s") from None
                tools, skipped = offered(listing)
                connected = True
                self._set(srv, status="connected", tools=tuple(tools), skipped=tuple(skipped))
                while (job := await srv.queue.get()) is not None:
                    srv.current = job
                    await self._call(client, job, name)
                    srv.current = None
        except asyncio.CancelledError:
            error = "stopped while busy"
        except BaseException as e:  # noqa: BLE001 - any failure of a server is its state, never the app's
            gone = _first_leaf(e, _Gone)
            if gone is not None:
                why = "the connection closed"
            elif isinstance(e, FileNotFoundError) and spec.command is not None and not connected:
                why = f"{spec.command!r} was not found"
            else:
                why = describe(e)
            status = "failed"
            error = f"{'stopped' if connected else 'cannot start'}: {why}{_last_line(srv.state.log, log_at)}"
        # the state first: whoever is answered next must not find the server still connected
        self._set(srv, status=status, error=error)
        if isinstance(gone, _Gone):
            _settle(gone.job.future, ToolResult(f"Error: the MCP server '{name}' stopped during the call.", "gone"))
        left = [srv.current] if srv.current is not None else []
        while not srv.queue.empty():
            left.append(srv.queue.get_nowait())
        for job in left:
            if job is not None:
                _settle(job.future, ToolResult(f"Error: the MCP server '{name}' stopped.", "gone"))

    async def _connect(self, spec: ServerSpec, log: Path | None, stack: AsyncExitStack) -> Any:
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client

        if spec.command is not None:
            assert log is not None
            log.parent.mkdir(parents=True, exist_ok=True)
            errlog = stack.enter_context(open(log, "a", encoding="utf-8"))  # its stderr, never the terminal's
            params = StdioServerParameters(command=spec.command, args=list(spec.args), env=spec.env or None,
                                           cwd=spec.cwd)
            transport = stdio_client(params, errlog=errlog)
        else:
            import httpx2

            http = await stack.enter_async_context(httpx2.AsyncClient(
                headers=spec.headers, timeout=httpx2.Timeout(30.0, read=300.0)))
            assert spec.url is not None
            transport = streamable_http_client(spec.url, http_client=http)
        return await stack.enter_async_context(Client(transport))

    async def _call(self, client: Any, job: _Job, server: str) -> None:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        if job.future.done():  # given up on by the UI
            return
        try:
            async with asyncio.timeout(job.timeout_s):
                result = await client.call_tool(job.tool, job.arguments)
        except TimeoutError:
            _settle(job.future, ToolResult(f"Error: the tool did not answer within {job.timeout_s:g} s.", "timeout"))
            return
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                raise _Gone(job) from None
            _settle(job.future, ToolResult(f"Error: {e}", "error"))
            return
        except Exception as e:  # noqa: BLE001 - a malformed answer is the call's error
            _settle(job.future, ToolResult(f"Error: {describe(e)}", "error"))
            return
        text = result_text(result)
        error = result.is_error and not text.lower().startswith("error")
        _settle(job.future, ToolResult(f"Error: {text}" if error else text,
                                         "error" if result.is_error else "done"))


async def _list_tools(client: Any) -> list[Any]:
    tools, cursor = [], None
    for _ in range(100):  # pages; a server that never stops paging is cut off
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def offered(listing: list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """A server's tools as function specs (their schemas checked against the grammar, as the server checks a request's
    tools), and one line for each that cannot be offered. A spec keeps the tool's own name under "tool" where the
    name the model sees had to change."""
    tools, skipped = [], []
    for t in listing:
        name = t.name if NAME.match(t.name) else "".join(c if NAME.match(c) else "_" for c in t.name)[:64]
        try:
            spec = function_spec({"name": name, "description": t.description, "parameters": dict(t.input_schema)},
                                 t.name)
        except ToolSpecError as e:
            skipped.append(e.message)
            continue
        tools.append({**spec, "tool": t.name})
    return tools, skipped


def result_text(result: Any) -> str:
    """A CallToolResult as text for the model: its text parts, other parts named; its structured content where it has
    no text; cut at MAX_RESULT_CHARS."""
    import json

    parts = []
    for c in result.content:
        kind = getattr(c, "type", "")
        if kind == "text":
            parts.append(c.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {getattr(c, 'mime_type', '')}]")
        elif kind == "resource":
            parts.append(getattr(c.resource, "text", None) or f"[resource {c.resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource link {c.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts) or "(no output)"
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[... {len(text) - MAX_RESULT_CHARS} more characters cut]"
    return text


def _first_leaf(e: BaseException, kind: type[BaseException] = BaseException) -> BaseException | None:
    """The first exception of type `kind` in `e` or, an exception group, in its leaves."""
    if isinstance(e, BaseExceptionGroup):
        return next((x for x in (_first_leaf(y, kind) for y in e.exceptions) if x is not None), None)
    return e if isinstance(e, kind) else None


def describe(e: BaseException) -> str:
    """One line for an exception: the first leaf of an exception group, its errno text for an OSError."""
    e = _first_leaf(e) or e
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text or type(e).__name__


def _settle(future: concurrent.futures.Future[ToolResult], result: ToolResult) -> None:
    if not future.done():  # the UI may have stopped waiting (the user stopped the turn)
        future.set_result(result)


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _last_line(log: Path | None, since: int) -> str:
    """'; its last words: <line>' from what a stdio server wrote to stderr since `since` (bytes), else ''."""
    if log is None:
        return ""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            tail = f.read()[-4000:].decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return f"; it said: {lines[-1][:200]}" if lines else ""
