"""Settings kept as a module's globals (``import step_settings``), as scripts keep a config
module: read and written by steps in tests/test_jit_reached_code.py."""

steps = 0
scale = 1.0
