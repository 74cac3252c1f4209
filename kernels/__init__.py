"""Per-device kernel packages (imported as ``hal.kernels``)."""
