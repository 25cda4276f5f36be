"""MCP servers' tools in the chat app: the config file (`config.py`) and the connections, on a thread of their own
(`hub.py`). The chat screen offers the tools to the model and runs the calls the user allows (`tui/tool_runner.py`)."""
