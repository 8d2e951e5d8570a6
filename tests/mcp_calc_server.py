"""A stdio MCP server for the durable-agent tests: each start and each call is logged.

Run as ``python mcp_calc_server.py LOG``; the log file gets ``start`` when the server
process starts and ``add A B`` for each call, so a test can count both.
"""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

LOG = sys.argv[1]
server = MCPServer("calc", instructions="Use add for sums.")


def _log(line: str) -> None:
    with open(LOG, "a") as f:
        f.write(line + "\n")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    _log(f"add {a} {b}")
    return a + b


if __name__ == "__main__":
    _log("start")
    server.run()
