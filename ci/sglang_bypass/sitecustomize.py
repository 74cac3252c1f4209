"""FOR TESTS ONLY: applies the SGLang bypasses named in ``HAL_SGLANG_TEST_BYPASS`` (``ci/sglang_engine.py``
``BYPASSES``) in every Python started with this folder on ``PYTHONPATH``, SGLang's spawned scheduler processes
included. ``ci/sglang_engine.py:cpu_env(bypass=...)`` puts it there; nothing else does."""

import os

if os.environ.get("HAL_SGLANG_TEST_BYPASS"):
    import importlib.util

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sglang_engine.py")
    _spec = importlib.util.spec_from_file_location("_hal_sglang_engine_bypass", _path)
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install_bypasses(os.environ["HAL_SGLANG_TEST_BYPASS"].split(","))
