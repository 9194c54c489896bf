"""The Docker seam: sandboxes (``engine``) and each runner's isolation shape (``isolation``).
Only these modules import docker (a ruff rule keeps it so)."""
