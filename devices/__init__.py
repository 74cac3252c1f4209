"""Per-device families (imported as ``hal.devices``)."""
