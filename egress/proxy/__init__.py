"""The egress proxy process: mitmproxy with covey's addon, its relay, resolver and policy feed.

No Django here (an import-linter contract keeps it so): the proxy runs in the egress image
with no database, as ``python -m egress.proxy`` (policy from the control plane with a runner
token), and on the control-plane host as ``manage.py egress_proxy`` (policy from the
database), both through :func:`egress.proxy.server.serve`.
"""
