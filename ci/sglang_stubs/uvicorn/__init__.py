"""IMPORT-ONLY STAND-IN for uvicorn: not uvicorn. Importing works; calling anything raises.

See ci/sglang_stubs/_hal_sglang_stub.py for why hal's `sglang` test env carries it.
"""

from _hal_sglang_stub import stub_package

stub_package(__name__, globals(), "0.38.0+hal.importstub")
