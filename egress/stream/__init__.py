"""The policy stream: runner hosts' proxies hear of each policy change as it is committed.

A proxy on a runner host holds one request open to ``manage.py policy_stream`` (an aiohttp
process of the control plane) and reads a line for each change of its organisation's policy:
the agents that changed, whole, not the organisation's snapshot. The process hears of changes
from the database itself (PostgreSQL ``LISTEN``: triggers on the tables the policy is made of
``NOTIFY`` at commit, egress/migrations/0003_policy_notices.py), so every change counts,
whatever made it. No Django here: the database is read through a seam
(:class:`egress.stream.hub.Store`, whose Django side is runners/streaming.py, on
egress/sources.py); docs/egress.md says how it runs, and how a proxy falls back to polling when
the stream is away.
"""
