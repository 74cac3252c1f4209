"""Batches the conformance suite runs, and a builder that makes them on any device.

A :class:`Case` names a forward mode, the requests (cached prefix, new tokens) and the
layer's shape and features. :func:`build` lays the requests out in a KV pool filled
with noise (every layer different), pages shuffled so that nothing works by accident,
and returns everything a forward needs plus what the float64 reference says it must
produce, for the output and for the whole pool.

:func:`check_cache` and :func:`check_output` compare a backend's result with that
expectation and say what differs in the porter's terms: which layer and slots of the
cache (a missing write, a wrong one, a write outside ``out_cache_loc``), which
requests, positions and heads of the output, reference against got.

One module per job, all importable from here: the case type (``hal.conformance.case``),
the batch builder (``builder``), the comparisons (``compare``) and the catalogue of cases
with the port-shaped selection :func:`cases_for` (``catalogue``).
"""

from __future__ import annotations

import torch

from hal.batch import ForwardMode
from hal.conformance.builder import Built, build, sub_batch, to_device
from hal.conformance.case import LARGE_LOGITS_Q_SCALE, Case
from hal.conformance.catalogue import CASES, GRAPH_CASES, cases_for, graph_capture_sizes, graph_replays
from hal.conformance.compare import check_cache, check_output, describe, tolerance

__all__ = [
    "Case",
    "Built",
    "CASES",
    "GRAPH_CASES",
    "LARGE_LOGITS_Q_SCALE",
    "ForwardMode",
    "build",
    "cases_for",
    "check_cache",
    "check_output",
    "describe",
    "graph_capture_sizes",
    "graph_replays",
    "sub_batch",
    "to_device",
    "tolerance",
    "torch",
]
