"""What a conformance test runs on a target: the target's backend for a case (or a skip naming what it declares),
the first plain case of a mode it serves, and the record of the chosen case that ``hal check`` reads. Shared by
:mod:`hal.conformance.suite` and the families beside it (:mod:`hal.conformance.output`)."""

from __future__ import annotations

import pytest

from hal.batch import ForwardMode
from hal.conformance.cases import CASES, Case, cases_for


def _backend_for(target, case: Case, graph: bool = False):
    reasons = target.backend.unsupported_reasons(case.config(graph=graph), target.capability)
    if reasons:
        pytest.skip(f"{target.id} declares it cannot serve {case.id}: " + "; ".join(reasons))
    return target.create(case.config(graph=graph))


def _record(request, case: Case, family: str | None = None) -> None:
    """Tell ``hal check`` which case a test chose at run time (page size, dtype, KV cache dtype)."""
    detail = {"case": case.id, "page_size": case.page_size, "dtype": case.dtype_name, "kv_dtype": case.kv_dtype_name}
    request.node.user_properties.append(("hal_case_detail", {**detail, "family": family}))


def _first_servable(target, mode: ForwardMode, prefix: bool = True) -> Case:
    """The first plain case of ``mode`` (with a cached prefix) the target declares it can serve."""
    for case in cases_for(target.backend, CASES, target.capability):
        if case.mode != mode or case.family not in ("basic", "paged", "page_boundaries"):
            continue
        if prefix and not all(p > 0 for p, _ in case.requests[:1]):
            continue
        if not target.backend.unsupported_reasons(case.config(), target.capability):
            return case
    pytest.skip(f"{target.id} declares it can serve no plain {mode.name} case")
