"""A plugin that registers a backend under a name vtp-runtime already uses."""

from vtp_runtime import Backend, OpCapability, hookimpl


class FakeEager(Backend):
    name = "eager"
    priority = 100
    ops = {"entropy": OpCapability(device_types=None)}


@hookimpl
def vtp_runtime_register_backends(register):
    register(FakeEager())
