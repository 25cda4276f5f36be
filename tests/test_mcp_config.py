"""The chat app's mcp.json: the mcpServers shape of Claude Desktop and LM Studio, each mistake one line naming the
file and the field (or line and column); the tools a server lists as the model is offered them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from app.tui.mcp.config import ConfigError, ServerSpec, load_config
from app.tui.mcp.hub import describe, offered, result_text
from app.tui.tool_runner import catalog


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(text)
    return path


def test_no_file_is_no_servers(tmp_path: Path) -> None:
    assert load_config(tmp_path / "mcp.json") is None


def test_stdio_and_http_servers(tmp_path: Path) -> None:
    path = write(tmp_path, """{"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "server-filesystem", "/tmp"], "env": {"A": "1"}},
        "web": {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer x"}, "timeout": 5},
        "off": {"command": "x", "disabled": true}}}""")
    config = load_config(path)
    assert config is not None
    assert config.servers == [
        ServerSpec("files", command="npx", args=("-y", "server-filesystem", "/tmp"), env={"A": "1"}),
        ServerSpec("web", url="http://127.0.0.1:8000/mcp", headers={"Authorization": "Bearer x"}, timeout_s=5.0)]
    assert config.errors == [] and config.disabled == ["off"]
    assert [s.transport for s in config.servers] == ["stdio", "http"]


def test_a_file_that_is_not_json_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{"mcpServers": {\n  "x": {"command": "a",}\n}}')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: line 2, column 24: Expecting property name enclosed in double quotes"


@pytest.mark.parametrize("text, message", [
    ("[]", 'expected an object with "mcpServers": {"name": {"command": ...} or {"url": ...}}, got an array'),
    ('{"servers": {}}', 'expected an object with "mcpServers": {"name": {"command": ...} or {"url": ...}}, got no '
                        'mcpServers'),
    ('{"mcpServers": []}', '"mcpServers" must be an object of named servers, got an array'),
])
def test_a_file_of_the_wrong_shape_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: {message}"


@pytest.mark.parametrize("entry, message", [
    ('"npx"', 'expected an object with "command" or "url", got a string'),
    ('{}', 'needs exactly one of "command" (a program to run) or "url" (a streamable HTTP endpoint)'),
    ('{"command": "a", "url": "http://x"}', 'needs exactly one of "command" (a program to run) or "url" (a '
                                            'streamable HTTP endpoint)'),
    ('{"command": "a", "args": "b"}', '"args" must be an array of strings'),
    ('{"command": "a", "env": {"A": 1}}', '"env" must be an object of strings'),
    ('{"url": "ftp://x"}', '"url" must be an http:// or https:// URL, got \'ftp://x\''),
    ('{"url": "http://x", "type": "sse"}', '"type" must be "stdio" or "http", got \'sse\' (the SSE transport is not '
                                           'supported: use the server\'s streamable HTTP URL)'),
    ('{"command": "a", "timeout": 0}', '"timeout" must be a number of seconds above 0, got 0'),
])
def test_a_wrong_server_entry_is_left_out_naming_the_field(tmp_path: Path, entry: str, message: str) -> None:
    path = write(tmp_path, f'{{"mcpServers": {{"bad": {entry}, "good": {{"command": "ok"}}}}}}')
    config = load_config(path)
    assert config is not None
    assert config.errors == [f"{path}: mcpServers.bad: {message}"]
    assert [s.name for s in config.servers] == ["good"]


def tool(name: str, schema: dict, description: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(name=name, description=description, input_schema=schema)


def test_tools_are_offered_closed_and_checked() -> None:
    tools, skipped = offered([
        tool("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "Adds."),
        tool("get weather", {"type": "object", "properties": {}}),
        tool("never", {"type": "object", "properties": {"x": {"type": "string", "minLength": 5, "maxLength": 2}},
                       "required": ["x"]}),
    ])
    assert tools == [
        {"name": "add", "description": "Adds.", "tool": "add",
         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                        "additionalProperties": False}},
        {"name": "get_weather", "tool": "get weather",
         "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    ]
    assert len(skipped) == 1 and skipped[0].startswith("'never.parameters' is not a JSON Schema a reply can be held to")


def test_two_servers_with_a_tool_of_one_name_are_told_apart() -> None:
    spec = {"parameters": {"type": "object"}}
    states = [SimpleNamespace(name="a", status="connected", tools=({"name": "search", "tool": "search", **spec},
                                                                   {"name": "add", "tool": "add", **spec})),
              SimpleNamespace(name="b b", status="connected", tools=({"name": "search", "tool": "search", **spec},)),
              SimpleNamespace(name="c", status="failed", tools=({"name": "add", "tool": "add", **spec},))]
    assert {k: (v["server"], v["tool"]) for k, v in catalog(states).items()} == {
        "a_search": ("a", "search"), "add": ("a", "add"), "b_b_search": ("b b", "search")}


def test_results_and_errors_read_as_one_text() -> None:
    text = SimpleNamespace(type="text", text="5")
    image = SimpleNamespace(type="image", mime_type="image/png")
    assert result_text(SimpleNamespace(content=[text, image], structured_content=None)) == "5\n[image: image/png]"
    assert result_text(SimpleNamespace(content=[], structured_content={"r": 1})) == '{"r": 1}'
    assert result_text(SimpleNamespace(content=[], structured_content=None)) == "(no output)"
    many = SimpleNamespace(content=[SimpleNamespace(type="text", text="x" * 4010)], structured_content=None)
    long = result_text(many)
    assert long == "x" * 4000 + "\n[... 10 more characters cut]"
    group = ExceptionGroup("outer", [ExceptionGroup("inner", [ConnectionError("All connection attempts failed")])])
    assert describe(group) == "All connection attempts failed"
