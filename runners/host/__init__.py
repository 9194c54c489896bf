"""The runner host: what a runner process does on its machine, with no database and no Django
(an import-linter contract keeps it so): ``python -m runners.host`` runs ``process`` (the host,
its threads and its status listener) with ``worker`` (its own Celery app, whose order tasks act
for that host) over ``broker`` when the broker is the file system, all told by ``config``
(``HostSettings.from_environment()``). ``runner`` takes orders and watches sandboxes, made of
``shapes`` (each runner's isolation shape), ``trust`` (probes and proxy checks: whether a
runner may take work), ``output`` (a running sandbox's output, live), ``quotas`` (the homes of
runs launched here, and their quotas) and ``engine_watch`` (the Docker engine going and coming
back);
``identity`` is a runner's file and token; ``client`` is the one module that speaks HTTP to the
control plane; ``containers`` is the Docker seam (sandboxes, and the isolation shape: networks
and the proxy container), the only place docker is imported; ``firewall`` holds the host rules
hard isolation needs; ``sealing`` opens a renewed token. The
egress probe itself is in ``runners.probe``."""
