"""The in-process ``gradclip`` runner of the CLI tests, for inspecting the monitor's dumps."""

from tests.cli.conftest import gradclip  # noqa: F401
