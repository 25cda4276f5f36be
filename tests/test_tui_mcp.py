"""MCP tools in the chat app, end to end: a real MCP server (the SDK's MCPServer, v1's FastMCP) run from mcp.json
over stdio (and one over streamable HTTP), the app driven with Pilot on the scripted fake engine, whose replies call
tools in the JSON format. Each call is shown and asked about; its result goes back to the model as a `tool`
message; a server that cannot start, stops or is too slow, and a config that does not parse, are lines in the
chat, never a crash."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.toolcalls.tools import AFTER_RESULTS
from app.tui.tool_runner import DECLINED, INTERRUPTED, LIMIT_NOTE, MAX_TOOL_CALLS
from app.tui.widgets.messages import MessageView
from app.tui.widgets.tool_call import ChatNote, ToolCallView
from tests.support.tui_fake_engine import FakeReply
from tests.support.tui_helpers import make_app, ready, screen_text, send, transcript, wait_for

SERVER = '''
import os, sys, time
from mcp.server.mcpserver import MCPServer

server = MCPServer("demo")


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def sleep(seconds: float) -> str:
    """Waits, then says so."""
    time.sleep(seconds)
    return "slept"


@server.tool()
def die() -> str:
    """Ends the server's process."""
    os._exit(3)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run()
'''
CONNECT_S = 60.0  # the server's Python starts and imports the SDK: seconds on a busy machine


@pytest.fixture
def server_script(tmp_path: Path) -> Path:
    path = tmp_path / "demo_server.py"
    path.write_text(SERVER)
    return path


def configure(home: Path, servers: dict) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def demo(script: Path, **extra) -> dict:
    return {"command": sys.executable, "args": [str(script)], **extra}


async def connected(pilot, name: str = "demo") -> None:
    app = pilot.app
    await wait_for(pilot, lambda: any(s.name == name and s.status in ("connected", "failed")
                                      for s in app.mcp.states()), timeout=CONNECT_S, what=f"{name} connected")
    state = app.mcp.states_by_name()[name]
    assert state.status == "connected", state.error


def notes(app) -> list[str]:
    return [str(n.render()) for n in app.chat_screen.query(ChatNote)]


def tool_views(app) -> list[ToolCallView]:
    return list(app.chat_screen.query(ToolCallView))


async def asking(pilot, n: int = 1) -> ToolCallView:
    await wait_for(pilot, lambda: len(tool_views(pilot.app)) >= n and tool_views(pilot.app)[n - 1].status == "asking",
                   what="a call asking for approval")
    return tool_views(pilot.app)[n - 1]


async def answered(pilot, text: str) -> None:
    await wait_for(pilot, lambda: transcript(pilot.app)[-1] == ("assistant", "done", text)
                   and pilot.app.chat_screen.tool_worker is None, timeout=15, what=f"the reply {text!r}")


CALL_ADD = {"name": "add", "arguments": {"a": 2, "b": 3}, "server": "demo", "tool": "add"}


async def test_a_call_allowed_once_runs_and_its_result_goes_back(tmp_path: Path, server_script: Path) -> None:
    configure(tmp_path, {"demo": demo(server_script)})
    app, backend = make_app(tmp_path, script=[FakeReply.call("add", {"a": 2, "b": 3}), FakeReply.answer("It is 5."),
                                              FakeReply.call("add", {"a": 2, "b": 3}), FakeReply.answer("Still 5.")])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        assert "MCP: demo 3 tools · F8" in str(app.chat_screen.query_one("#mcp-status").render())
        await send(pilot, "What is 2 + 3?")
        view = await asking(pilot)
        assert view.call == CALL_ADD and app.focused is view
        await pilot.press("y")
        await answered(pilot, "It is 5.")
        assert app.focused is app.chat_screen.query_one("#prompt")  # typing is not taken for the call's keys
        assert transcript(app) == [("user", "done", "What is 2 + 3?"), ("assistant", "done", ""),
                                   ("tool", "done", "5"), ("assistant", "done", "It is 5.")]
        first, second = backend.engine.requests
        offered = first.sampling.response_format.schema
        assert [c["properties"]["name"]["const"] for c in offered["anyOf"][0]["properties"]["tool_calls"]["items"]
                ["anyOf"]] == ["add", "sleep", "die"]
        assert second.messages[-3:] == [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": '{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}'},
            {"role": "tool", "content": "5\n\n" + AFTER_RESULTS.format(s="", verb="has")}]
        rows = app.store.messages(app.chat_screen.chat.id)
        assert [(m.role, m.content, m.status) for m in rows][2] == ("tool", "5", "done")
        assert rows[2].stats == {"tool_call": CALL_ADD}
        await send(pilot, "Again?")  # asked again: "once" was for that call
        await asking(pilot, 2)
        await pilot.press("y")
        await answered(pilot, "Still 5.")


async def test_always_allows_the_tool_for_the_chat_and_deny_tells_the_model(tmp_path: Path,
                                                                           server_script: Path) -> None:
    configure(tmp_path, {"demo": demo(server_script)})
    app, backend = make_app(tmp_path, script=[
        FakeReply.call("add", {"a": 1, "b": 1}), FakeReply.answer("Two."),
        FakeReply.call("add", {"a": 2, "b": 2}), FakeReply.answer("Four."),
        FakeReply.call("sleep", {"seconds": 0}), FakeReply.answer("Fine, I won't.")])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        await send(pilot, "1+1?")
        await asking(pilot)
        await pilot.press("a")
        await answered(pilot, "Two.")
        await send(pilot, "2+2?")
        await answered(pilot, "Four.")  # no question: add is allowed in this chat
        assert [v.status for v in tool_views(app)] == ["done", "done"]
        assert [v.content for v in tool_views(app)] == ["2", "4"]
        await send(pilot, "Wait?")
        await asking(pilot, 3)  # another tool is asked about
        await pilot.press("n")
        await answered(pilot, "Fine, I won't.")
        assert tool_views(app)[2].status == "denied" and tool_views(app)[2].content == DECLINED
        assert backend.engine.requests[-1].messages[-1] == {
            "role": "tool", "content": DECLINED + "\n\n" + AFTER_RESULTS.format(s="", verb="has")}


async def test_esc_stops_a_call_waiting_for_approval(tmp_path: Path, server_script: Path) -> None:
    configure(tmp_path, {"demo": demo(server_script)})
    app, backend = make_app(tmp_path, script=[FakeReply.call("add", {"a": 2, "b": 3}), "Hello."])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        await send(pilot, "What is 2 + 3?")
        await asking(pilot)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.chat_screen.tool_worker is None, what="the turn stopped")
        assert transcript(app)[-1] == ("tool", "stopped", "The user stopped this call, so it has no result.")
        assert len(backend.engine.requests) == 1  # the model was not asked to go on
        await send(pilot, "Hi")
        await answered(pilot, "Hello.")


async def test_a_slow_call_times_out_and_the_model_is_told(tmp_path: Path, server_script: Path) -> None:
    configure(tmp_path, {"demo": demo(server_script, timeout=0.5)})
    app, backend = make_app(tmp_path, script=[FakeReply.call("sleep", {"seconds": 30}), FakeReply.answer("Too slow.")])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        await send(pilot, "Wait a while")
        await asking(pilot)
        started = time.monotonic()
        await pilot.press("y")
        await answered(pilot, "Too slow.")
        assert time.monotonic() - started < 10
        view = tool_views(app)[0]
        assert (view.status, view.content) == ("timeout", "Error: the tool did not answer within 0.5 s.")
        assert backend.engine.requests[-1].messages[-1]["content"].startswith(view.content)


async def test_a_server_that_cannot_start_is_a_line_and_the_app_chats_on(tmp_path: Path, server_script: Path) -> None:
    configure(tmp_path, {"broken": {"command": str(tmp_path / "no-such-server")}, "demo": demo(server_script)})
    app, backend = make_app(tmp_path, script=["Hello."])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        await wait_for(pilot, lambda: app.mcp.states_by_name()["broken"].status == "failed", what="broken failed")
        line = f"MCP server 'broken' cannot start: '{tmp_path / 'no-such-server'}' was not found"
        await wait_for(pilot, lambda: notes(app) == [line], what="the failure's line")
        assert "MCP: broken cannot start · demo 3 tools · F8" in str(
            app.chat_screen.query_one("#mcp-status").render())
        configure(tmp_path, {"broken": {"command": str(tmp_path / "no-such-server")}})
        app.reload_mcp()  # now only the broken one: no tools are offered, the reply is plain text
        await wait_for(pilot, lambda: notes(app) == [line, line], what="the failure's line again, once")
        await send(pilot, "Hi")
        await answered(pilot, "Hello.")
        assert backend.engine.requests[-1].sampling.response_format is None


async def test_a_server_that_dies_mid_call_is_an_error_result_and_a_line(tmp_path: Path, server_script: Path) -> None:
    configure(tmp_path, {"demo": demo(server_script)})
    app, backend = make_app(tmp_path, script=[FakeReply.call("die", {}), "It stopped."])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        await send(pilot, "Die")
        await asking(pilot)
        await pilot.press("y")
        await answered(pilot, "It stopped.")  # no server left: the last reply was offered no tools
        view = tool_views(app)[0]
        assert (view.status, view.content) == ("error", "Error: the MCP server 'demo' stopped during the call.")
        assert notes(app) == ["MCP server 'demo' stopped: the connection closed"]
        assert backend.engine.requests[-1].sampling.response_format is None
        assert backend.engine.requests[-1].messages[-1] == {"role": "tool", "content": view.content}


async def test_a_config_that_does_not_parse_is_one_line_and_no_server_runs(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {"demo": {"command": "x",}}}')
    app, backend = make_app(tmp_path, script=["Hello."])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        assert notes(app) == [f"MCP config {path}: line 1, column 41: Expecting property name enclosed in double "
                              "quotes; running without MCP servers."]
        assert app.mcp.states() == []
        assert "MCP: mcp.json has an error, no servers run · F8" in str(
            app.chat_screen.query_one("#mcp-status").render())
        await send(pilot, "Hi")
        await answered(pilot, "Hello.")
        await pilot.press("f8")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "MCPScreen", what="the MCP screen")
        assert f"{path}: line 1, column 41" in str(app.screen.query_one("#mcp-servers").render())


async def test_a_reasoning_model_thinks_then_calls_and_both_are_shown_and_saved(tmp_path: Path,
                                                                                 server_script: Path) -> None:
    configure(tmp_path, {"demo": demo(server_script)})
    thought = "The user wants a sum. The add tool does that."
    app, backend = make_app(tmp_path, reasoning="think", script=[
        FakeReply.call("add", {"a": 2, "b": 3}, thought=thought), FakeReply.answer("It is 5.", thought="Got 5.")])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        await send(pilot, "What is 2 + 3?")
        call = await asking(pilot)
        first = [v for v in app.chat_screen.query(MessageView) if v.role == "assistant"][0]
        # the reply held only a call and its thinking: the thought stays shown above the call, collapsed
        assert first.display and first.content == "" and first.reasoning == thought
        assert first.thought is not None and first.thought.text == thought
        text = screen_text(app)
        assert text.index("Thought for") < text.index("Tool · add on demo")
        assert app.focused is call and "The add tool does that." not in text
        await pilot.press("f5")  # the thinking's key, while the call asking has the focus: the last thought opens
        assert first.thought.expanded and "The add tool does that." in screen_text(app) and app.focused is call
        await pilot.press("y")
        await answered(pilot, "It is 5.")
        assert call.status == "done" and call.content == "5"
        assert transcript(app) == [("user", "done", "What is 2 + 3?"), ("assistant", "done", ""),
                                   ("tool", "done", "5"), ("assistant", "done", "It is 5.")]
        first_request, second_request = backend.engine.requests
        assert first_request.sampling.response_format is not None  # the tools were offered to the thinking model
        assert all(thought not in str(m["content"]) for m in second_request.messages)  # thinking is never sent back
        assert second_request.messages[-2] == {
            "role": "assistant", "content": '{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}'}
        chat = app.chat_screen.chat
        rows = app.store.messages(chat.id)
        assert [(m.role, m.reasoning) for m in rows] == [("user", ""), ("assistant", thought), ("tool", ""),
                                                         ("assistant", "Got 5.")]
        assert rows[1].stats["reasoning_tokens"] > 0 and rows[2].stats == {"tool_call": CALL_ADD}
        await app.chat_screen.open_chat(chat)  # read back from the store
        await pilot.pause()
        views = list(app.chat_screen.query(MessageView))
        assert [type(v).__name__ for v in views] == ["MessageView", "MessageView", "ToolCallView", "MessageView"]
        assert views[1].display and views[1].thought is not None and views[1].thought.text == thought
        assert views[2].call == CALL_ADD and views[3].reasoning == "Got 5."


async def test_the_turn_stops_offering_tools_after_the_limit(tmp_path: Path, server_script: Path) -> None:
    configure(tmp_path, {"demo": demo(server_script)})
    script = [FakeReply.call("add", {"a": i, "b": 1}) for i in range(MAX_TOOL_CALLS)] + ["I give up."]
    app, backend = make_app(tmp_path, script=script)
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        await send(pilot, "Count")
        await asking(pilot)
        await pilot.press("a")
        await answered(pilot, "I give up.")
        assert [v.content for v in tool_views(app)] == [str(i + 1) for i in range(MAX_TOOL_CALLS)]
        assert notes(app) == [LIMIT_NOTE]
        requests = backend.engine.requests
        assert len(requests) == MAX_TOOL_CALLS + 1
        assert all(r.sampling.response_format is not None for r in requests[:-1])
        assert requests[-1].sampling.response_format is None


async def test_a_call_left_waiting_at_quit_reads_back_stopped(tmp_path: Path, server_script: Path) -> None:
    configure(tmp_path, {"demo": demo(server_script)})
    app, _ = make_app(tmp_path, script=[FakeReply.call("add", {"a": 2, "b": 3})])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await connected(pilot)
        await send(pilot, "What is 2 + 3?")
        await asking(pilot)
    app, backend = make_app(tmp_path, script=["Sorry."])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        assert transcript(app) == [("user", "done", "What is 2 + 3?"), ("assistant", "done", ""),
                                   ("tool", "stopped", "The user stopped this call, so it has no result.")]
        assert tool_views(app)[0].call == CALL_ADD
        await send(pilot, "Never mind")
        await answered(pilot, "Sorry.")
        assert backend.engine.requests[-1].messages[-3:-1] == [
            {"role": "assistant", "content": '{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}'},
            {"role": "tool", "content": "The user stopped this call, so it has no result."}]


async def test_a_call_the_app_never_settled_reads_back_interrupted(tmp_path: Path) -> None:
    from app.tui.store import ChatStore

    store = ChatStore(tmp_path / "chats.db")  # as a killed app left it: the call's row still streaming
    chat = store.create_chat("killed")
    store.add_message(chat.id, "user", "What is 2 + 3?")
    store.add_message(chat.id, "assistant", "")
    store.add_message(chat.id, "tool", "", status="streaming", stats={"tool_call": CALL_ADD})
    store.close()
    app, backend = make_app(tmp_path, script=["Sorry."])
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        assert transcript(app)[1:] == [("assistant", "done", ""), ("tool", "interrupted", "")]
        assert [v.display for v in app.chat_screen.query("MessageView")] == [True, False, True]
        await send(pilot, "Never mind")
        await answered(pilot, "Sorry.")
        assert backend.engine.requests[-1].messages[-4:-1] == [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": '{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}'},
            {"role": "tool", "content": INTERRUPTED}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_server_over_streamable_http(tmp_path: Path, server_script: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(server_script), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + CONNECT_S
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        configure(tmp_path, {"web": {"url": f"http://127.0.0.1:{port}/mcp"}})
        app, backend = make_app(tmp_path, script=[FakeReply.call("add", {"a": 20, "b": 22}), FakeReply.answer("42.")])
        async with app.run_test(size=(110, 40)) as pilot:
            await ready(pilot)
            await connected(pilot, "web")
            await send(pilot, "20 + 22?")
            await asking(pilot)
            await pilot.press("y")
            await answered(pilot, "42.")
            assert tool_views(app)[0].content == "42"
    finally:
        proc.terminate()
        proc.wait(10)
