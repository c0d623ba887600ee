"""Built-in backends, installed as ``vtp_runtime.backends.*``."""
