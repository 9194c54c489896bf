"""The runner host: what a runner process does on its machine, with no database and no Django
(an import-linter contract keeps it so). ``runner`` takes orders and watches sandboxes, made of
``shapes`` (each runner's isolation shape), ``trust`` (probes and proxy checks: whether a runner
may take work) and ``output`` (a running sandbox's output, live); ``config`` is what a host is
told at start; ``identity`` is a runner's file and token; ``client`` is the one module that
speaks HTTP to the control plane; ``containers`` is the Docker seam (sandboxes, and the
isolation shape: networks and the proxy container), the only place docker is imported;
``firewall`` holds the host rules hard isolation needs; ``sealing`` opens a renewed token. The
egress probe itself is in ``runners.probe``."""
