"""The runner host: what a runner process does on its machine, with no database and no Django
(an import-linter contract keeps it so). ``runner`` takes orders, watches sandboxes and reports;
``identity`` is a runner's file and token; ``client`` is the one module that speaks HTTP to the
control plane; ``containers`` is the Docker seam (sandboxes, and the isolation shape: networks
and the proxy container), the only place docker is imported; ``firewall`` holds the host rules
hard isolation needs; ``probing`` runs the egress probe; ``output`` sends a running sandbox's
output; ``sealing`` opens a renewed token."""
