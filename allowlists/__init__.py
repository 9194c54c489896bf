"""Allowlist entries: the grammar (``entries``, pure Python, shared with the egress proxy) and
the Django fields that hold lists of them (``fields``). Below every app: organisations, agents,
templates and egress all keep entries."""
