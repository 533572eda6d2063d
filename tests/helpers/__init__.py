"""What the test files share: process-group and GPU harnesses, simulated symmetric memory,
the interpreter checks, and the repository's paths. ``tests/`` is on ``sys.path`` for every
test (``pythonpath`` in ``pyproject.toml``), so tests import ``helpers.<module>``; spawned
worker processes inherit that path."""
