"""Adapters that put hal's backends inside serving engines (``hal.integrations.sglang``).

Each adapter imports its engine; nothing else in hal does.
"""
