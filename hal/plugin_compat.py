"""Plugin API 1: the names an API 1 plugin reaches that the current API lacks, served with warnings.

A plugin that declares no plugin API is taken as API 1 and runs through these shims:

* ``ForwardBatch.prefix_lens_cpu`` / ``query_lens_cpu`` / ``kv_lens_cpu`` (per request: cached tokens before
  the query, query tokens, keys attended over) and the method ``ForwardBatch.device_lens()``, which the
  batch protocols lack; their values are :func:`hal.batch.host_lens` / :func:`hal.batch.device_lens`.
* An API 1 backend's ``init_forward_metadata_out_graph`` assigns ``self.forward_metadata`` (API 1 has no
  ``set_forward_metadata``), and its ``__init__`` takes the capability only; :func:`adapt_api1_backend` stamps
  such metadata for the step and passes the config the way hal constructs backends.

Every shim warns (``DeprecationWarning``) with the replacement; ``hal info`` says that the plugin
"runs as plugin API 1 (deprecated names)".
"""

from __future__ import annotations

import functools
import inspect

import torch

from hal.deprecation import warn_renamed
from hal.errors import ConfigError
from hal.modes import device_lens, host_lens
from hal.validation import validation_level

__all__ = ["Api1BatchNames", "adapt_api1_backend", "API1_NOTE"]

API1_NOTE = "runs as plugin API 1 (deprecated names)"


class Api1BatchNames:
    """Plugin API 1's derived lengths of ``ForwardBatch``, kept as deprecated read-only names (a mixin)."""

    @property
    def prefix_lens_cpu(self) -> list[int]:
        """Deprecated: ``hal.batch.host_lens(fb).prefix``, cached tokens before each request's query tokens."""
        warn_renamed("ForwardBatch.prefix_lens_cpu", "hal.batch.host_lens(forward_batch).prefix", since="0.3.0")
        return list(host_lens(self).prefix)

    @property
    def query_lens_cpu(self) -> list[int]:
        """Deprecated: ``hal.batch.host_lens(fb).query``, each request's query tokens."""
        warn_renamed("ForwardBatch.query_lens_cpu", "hal.batch.host_lens(forward_batch).query", since="0.3.0")
        return list(host_lens(self).query)

    @property
    def kv_lens_cpu(self) -> list[int]:
        """Deprecated: ``hal.batch.host_lens(fb).kv``, the keys each request attends over (query tokens included)."""
        warn_renamed("ForwardBatch.kv_lens_cpu", "hal.batch.host_lens(forward_batch).kv", since="0.3.0")
        return list(host_lens(self).kv)

    def device_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Deprecated: ``hal.batch.device_lens(fb)``, ``(query_lens, kv_lens)`` int64 ``[B]`` on the device."""
        warn_renamed("ForwardBatch.device_lens()", "hal.batch.device_lens(forward_batch)", since="0.3.0")
        return device_lens(self)


def adapt_api1_backend(cls: type) -> type:
    """Make a plugin API 1 backend class run under this hal (in place, once; returns ``cls``).

    Its ``init_forward_metadata_out_graph`` may assign ``self.forward_metadata`` instead of calling
    ``set_forward_metadata(meta, forward_batch)``: the assignment is stamped for the step, with a warning.
    API 1 has no ``check_batch`` (only hal's own batches, validated when built, reached its backends), so the
    adapter runs it first: an engine's batch gets the backend's validation level as a ported backend gives it.
    An ``__init__(self, capability)`` without the config gets ``self.config`` set after it runs.
    """
    if cls.__dict__.get("_hal_api1_adapted"):
        return cls
    out_graph = cls.init_forward_metadata_out_graph

    @functools.wraps(out_graph)
    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        step = self._step
        self.check_batch(forward_batch)
        out_graph(self, forward_batch, in_capture)
        if self._step == step:  # nothing stamped: the API 1 way, self.forward_metadata = meta
            warn_renamed(
                f"{cls.__name__}: assigning self.forward_metadata in init_forward_metadata_out_graph",
                "self.set_forward_metadata(meta, forward_batch)",
                since="0.3.0",
            )
            self.set_forward_metadata(self.forward_metadata, forward_batch)

    cls.init_forward_metadata_out_graph = init_forward_metadata_out_graph
    init = cls.__init__
    if len(inspect.signature(init).parameters) == 2:  # (self, capability): API 1's constructor

        @functools.wraps(init)
        def __init__(self, capability, config=None, **options):
            validate = options.pop("validate", None)  # the base class's own option, not the backend's
            if options:
                raise ConfigError(
                    f"{cls.__name__} options {sorted(options)}: a plugin API 1 backend takes only hal's "
                    "validate= (its __init__ takes the capability only); declare plugin_api = 3 once it is ported"
                )
            init(self, capability)
            self.config = config
            if validate is not None:
                self.validation = validation_level(validate)

        cls.__init__ = __init__
    cls._hal_api1_adapted = True
    return cls
