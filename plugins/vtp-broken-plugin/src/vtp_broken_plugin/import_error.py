"""A plugin whose import fails, like one with a missing or incompatible dependency."""

raise ImportError("vtp_broken_plugin.import_error: this plugin needs a library that is not installed")
