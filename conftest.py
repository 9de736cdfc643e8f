"""Shared pytest set-up for tests/ and properties/: the project's plugin holds it
(forge_verify/pytest_plugin.py), so that an installed package runs the properties alike."""

pytest_plugins = ["forge_verify.pytest_plugin"]
