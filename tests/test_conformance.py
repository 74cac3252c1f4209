"""The project runs the shipped conformance suite on every available (device, backend)."""

from hal.conformance.suite import *  # noqa: F403
