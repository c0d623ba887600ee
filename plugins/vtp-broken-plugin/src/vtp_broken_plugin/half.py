"""A plugin that registers one valid backend and then an invalid one. A plugin is all or
nothing: ``broken_half_ok`` must not stay registered either."""

from vtp_runtime import Backend, OpCapability, hookimpl


class Valid(Backend):
    name = "broken_half_ok"
    ops = {"entropy": OpCapability(device_types=None)}


class Invalid(Backend):
    name = "broken_half_bad"
    ops = {"no_such_op": OpCapability(device_types=None)}


@hookimpl
def vtp_runtime_register_backends(register):
    register(Valid())
    register(Invalid())
