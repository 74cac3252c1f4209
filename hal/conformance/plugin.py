"""pytest plugin: parametrizes the conformance tests over the available (device, backend) pairs.

Tests marked ``hal_cases("forward" | "graph")`` are parametrized over the cases at the
page sizes each backend declares (``cases_for``); every item carries, in its
``user_properties``, the case record ``hal check`` reports (id, family, mode, page size, dtype, path).

Every target runs on each path its backend can take (``hal.conformance.paths``): the
default one, the checked prologue path where the backend also has a fused forward, and
the paths its device supplies (CPU ISA paths...); a test of a path runs under that
path's environment, and a path runs only the case families it declares (one case per shape of them where it
samples).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from hal.capability import DeviceCapability
from hal.conformance.paths import DEFAULT, Path, paths_for
from hal.registry import Device, device_backends, get_registry, probe_device


@dataclass(frozen=True)
class Target:
    """One (device, backend) pair under test, on one of the backend's paths."""

    device: Device
    capability: DeviceCapability
    backend: type
    path: Path = DEFAULT

    @property
    def id(self) -> str:
        return f"{self.device.name}-{self.backend.name}" + ("" if self.path.is_default else f"@{self.path.name}")

    def create(self, config=None, **options):
        """The backend on this target's path (run inside ``self.path.active()``, as the suite's tests are), made
        for ``config`` (the case's model, as an engine makes it) where given."""
        return self.backend(self.capability, config, **options)

    def paths(self) -> list[Path]:
        """Every path of this target's backend on its device (:func:`hal.conformance.paths.paths_for`)."""
        return paths_for(self.device, self.backend, self.capability, self.create)


def on_paths(targets: list[Target], only: list[str] | tuple = ()) -> list[Target]:
    """``targets`` on every path they can take here (``only``: these path names): the default one, then the others
    this machine can run, each with the capability its device reports under that path's environment."""
    out = []
    for target in targets:
        if not only or DEFAULT.name in only:
            out.append(target)
        for path in target.paths()[1:]:
            if path.unreached or (only and path.name not in only):
                continue
            with path.active():
                capability = probe_device(target.device) if path.env else target.capability
            if capability.available:
                out.append(replace(target, capability=capability, path=path))
    return out


def available_targets(devices: list[str] | None = None, backends: list[str] | None = None) -> list[Target]:
    """Every backend that can run on an available device here, optionally filtered by name."""
    targets = []
    for device in get_registry().ordered():
        if devices and device.name not in devices:
            continue
        cap = probe_device(device)
        if not cap.available:
            continue
        for cls in device_backends(device)[0]:
            if (not backends or cls.declaration().name in backends) and not cls.unavailable_reasons(cap):
                targets.append(Target(device, cap, cls))
    return targets


def _case_lists():
    from hal.conformance.cases import CASES, GRAPH_CASES
    from hal.conformance.cases_models import MODEL_CASES, MODEL_GRAPH_CASES

    return {"forward": CASES + MODEL_CASES, "graph": GRAPH_CASES + MODEL_GRAPH_CASES}


def target_cases(target: Target, kind: str, families=()) -> list:
    """The cases of ``kind`` (forward or graph) ``target`` runs: the catalogue's within what its backend declares
    (``cases_for``), the forward ones followed by the cases built from its declared shapes (``shape_cases``);
    on a path that samples, one case per shape of them (``one_per_shape``; those of ``families`` first, so the
    share that ``--hal-family`` keeps meets every shape of those families)."""
    from hal.conformance.catalogue import cases_for, one_per_shape, shape_cases

    cases = cases_for(target.backend, _case_lists()[kind], target.capability)
    if kind == "forward":
        cases += shape_cases(target.backend, target.capability)
    if not target.path.sample:
        return cases
    wanted = [not families or (c.family if kind == "forward" else "graph") in families for c in cases]
    return one_per_shape([c for c, w in zip(cases, wanted) if w] + [c for c, w in zip(cases, wanted) if not w])


def pytest_addoption(parser):
    group = parser.getgroup("hal", "hal conformance suite")
    group.addoption("--hal-device", action="append", default=[], help="only this device (repeatable)")
    group.addoption("--hal-backend", action="append", default=[], help="only this backend (repeatable)")
    group.addoption(
        "--hal-family", action="append", default=[], help="only this feature family (repeatable; see hal check)"
    )
    group.addoption(
        "--hal-path", action="append", default=[], help="only this path of each backend (repeatable; see hal check)"
    )
    group.addoption("--hal-fuzz", type=int, default=0, help="random batches per backend (0: no fuzzing)")
    group.addoption("--hal-seed", type=int, default=0, help="seed of the random batches")


def pytest_configure(config):
    config.addinivalue_line("markers", "hal_cases(kind): parametrize over the conformance cases of kind")
    config.addinivalue_line("markers", "hal_family(name): the feature family a conformance test covers")


def pytest_generate_tests(metafunc):
    if "hal_target" not in metafunc.fixturenames:
        return
    devices = metafunc.config.getoption("hal_device") or None
    backends = metafunc.config.getoption("hal_backend") or None
    targets = available_targets(devices, backends)
    if not targets:
        wanted = f"device {devices or 'any'}, backend {backends or 'any'}"
        pytest.fail(f"no available (device, backend) matches {wanted}: see `hal info`", pytrace=False)
    targets = on_paths(targets, metafunc.config.getoption("hal_path"))
    marker = metafunc.definition.get_closest_marker("hal_cases")
    if marker is None or "hal_case" not in metafunc.fixturenames:
        metafunc.parametrize("hal_target", targets, ids=[t.id for t in targets])
        return
    kind, families = marker.args[0], metafunc.config.getoption("hal_family")
    pairs = [(t, c) for t in targets for c in target_cases(t, kind, families)]
    metafunc.parametrize(("hal_target", "hal_case"), pairs, ids=[f"{t.id}-{c.id}" for t, c in pairs])


def case_record(item) -> dict | None:
    """What ``hal check`` reports about a conformance item: id, family, mode, page_size, dtype, kv_dtype (the KV
    cache's dtype name; None where the test chooses its case at run time)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "hal_target" not in callspec.params:
        return None
    params = callspec.params
    name = item.originalname or item.name.split("[")[0]
    case = params.get("hal_case")
    cases_marker = item.get_closest_marker("hal_cases")
    family_marker = item.get_closest_marker("hal_family")
    path = params["hal_target"].path
    at = "" if path.is_default else f"@{path.name}"
    if case is not None:
        kind = cases_marker.args[0] if cases_marker else "forward"
        return {
            "id": f"{kind}:{case.id}{at}",
            "family": "graph" if kind == "graph" else case.family,
            "mode": case.mode.name,
            "page_size": case.page_size,
            "dtype": case.dtype_name,
            "kv_dtype": case.kv_dtype_name,
            "test": name,
            "path": path.name,
        }
    rest = [getattr(v, "name", str(v)) for k, v in sorted(params.items()) if k != "hal_target"]
    mode = params.get("mode")
    family = family_marker.args[0] if family_marker else name.removeprefix("test_")
    if mode is not None:
        mode_name = mode.name
    else:
        mode_name = "ANY" if family == "fuzz" else "IDLE" if "idle" in name else "DECODE"
    return {
        "id": ":".join([name.removeprefix("test_"), *rest]) + at,
        "family": family,
        "mode": mode_name,
        "page_size": None,
        "dtype": None,
        "kv_dtype": None,
        "test": name,
        "path": path.name,
    }


def pytest_collection_modifyitems(config, items):
    families = set(config.getoption("hal_family"))
    fuzz = config.getoption("hal_fuzz")
    keep, drop, known = [], [], set()
    for item in items:
        record = case_record(item)
        if record is not None:
            known.add(record["family"])
            item.user_properties.append(("hal_case", record))
            off_path = not item.callspec.params["hal_target"].path.runs(record["family"], record["mode"])
            if (record["family"] == "fuzz" and not fuzz) or (families and record["family"] not in families) or off_path:
                drop.append(item)
                continue
        keep.append(item)
    unknown = families - known
    if unknown and known:  # (nothing collected at all: no target here, reported as such)
        raise pytest.UsageError(
            f"family {sorted(unknown)} (--family, --hal-family): no conformance test of this run is of it; "
            f"expected some of {sorted(known)}"
        )
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _hal_path(request):
    """A conformance test runs under its target's path: that path's environment, the fused forward off on
    ``checked``."""
    callspec = getattr(request.node, "callspec", None)
    target = callspec.params.get("hal_target") if callspec is not None else None
    if target is None or target.path.is_default:
        yield
        return
    with target.path.active():
        yield
