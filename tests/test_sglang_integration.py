"""``hal.integrations.sglang``: hal's backends under SGLang's own objects.

The first tests run everywhere (SGLang absent: a clear hal error; nothing else in hal
imports SGLang). The rest need SGLang (``tox -e sglang``) and drive hal through SGLang's
real ``ModelRunner`` mock, ``ForwardBatch``, ``RadixAttention``, ``ReqToTokenPool`` and
``MHATokenToKVPool`` from its attention kit; SGLang's whole kit runs in ``ci/sglang_kit.py``.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import hal

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)


def test_import_without_sglang_is_a_hal_error():
    done = _python(
        "import sys; sys.modules['sglang'] = None\n"  # as if SGLang were not installed
        "from hal.errors import MissingDependencyError\n"
        "try:\n"
        "    import hal.integrations.sglang\n"
        "except MissingDependencyError as exc:\n"
        "    assert isinstance(exc, ImportError), exc\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "needs SGLang" in done.stdout and "docs/sglang.md" in done.stdout


def test_the_rest_of_hal_never_imports_sglang():
    done = _python(
        "import sys, pkgutil, importlib; sys.modules['sglang'] = None\n"
        "import hal, hal.devices, hal.kernels\n"
        "names = [m.name for pkg in (hal, hal.devices, hal.kernels)\n"
        "         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.') if '.integrations.' not in m.name]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names))\n"
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 30
    for path in [*ROOT.glob("hal/**/*.py"), *ROOT.glob("devices/**/*.py"), *ROOT.glob("kernels/**/*.py")]:
        if "integrations" not in path.parts:
            assert "import sglang" not in path.read_text() and "from sglang" not in path.read_text(), path


@pytest.mark.parametrize("backend_name", ["torch", "ascend"])
def test_metadata_is_exposed_under_sglangs_names(monkeypatch, backend_name):
    """SGLang's kit and tools read ``forward_metadata.kv_indptr`` / ``kv_indices``: every key's slot, CSR."""
    from hal.batch import ForwardMode
    from hal.conformance.cases import Case, build
    from hal.selection import select

    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    case = Case("names", ForwardMode.EXTEND, ((0, 20), (14, 5), (40, 1)), page_size=16)
    built = build(case)
    config = hal.AttentionConfig(tp_q_head_num=4, tp_k_head_num=2, head_dim=64, dtype=torch.float32, page_size=16)
    backend = select(config, device="npu" if backend_name == "ascend" else "cpu", backend=backend_name).create()
    backend.init_forward_metadata(built.batch)
    meta = backend.forward_metadata
    kv = [p + n for p, n in case.requests]
    assert meta.kv_indptr.tolist() == [0, *itertools.accumulate(kv)]
    table, rows = built.batch.req_to_token_pool.req_to_token, built.batch.req_pool_indices.tolist()
    assert meta.kv_indices.tolist() == [s for r, n in zip(rows, kv) for s in table[r, :n].tolist()]
