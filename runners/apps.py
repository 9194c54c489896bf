"""The runners app."""

from django.apps import AppConfig


class RunnersConfig(AppConfig):
    """Runners: hosts that build and run sandboxes, placed by labels."""

    name = "runners"

    def ready(self) -> None:
        from organisations import services as organisations
        from runners import checks  # noqa: F401  (registers the system checks)
        from runners.services import ensure_builtin_runner, remove_builtin_runner

        # Every new organisation gets its built-in runner (organisations imports no app).
        if ensure_builtin_runner not in organisations.when_created:
            organisations.when_created.append(ensure_builtin_runner)
            organisations.when_deleting.append(remove_builtin_runner)
