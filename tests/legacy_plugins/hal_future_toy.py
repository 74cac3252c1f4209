"""A device plugin written for a hal plugin API this release does not implement (a future major)."""

from hal.registry import Device

HAL_PLUGIN_API = 99


class FutureDevice(Device):
    name = "futuretoy"

    def probe(self, index=None):
        raise AssertionError("never probed: the registry refuses an unknown plugin API first")

    def backends(self):
        return []


device = FutureDevice()
