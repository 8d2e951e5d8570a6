"""The deterministic side of tether: the workflow event loop, replay and primitives."""
