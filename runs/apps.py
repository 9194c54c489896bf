"""The runs app."""

from django.apps import AppConfig


class RunsConfig(AppConfig):
    """Runs: queueing, placement, the run API and what runners report."""

    name = "runs"

    def ready(self) -> None:
        from runners import services as runners
        from runs.services import place_waiting

        # A runner that can take work again (resumed, heard from, trusted) gets what waits
        # (runners sit below runs and cannot call it themselves).
        if place_waiting not in runners.when_available:
            runners.when_available.append(place_waiting)
