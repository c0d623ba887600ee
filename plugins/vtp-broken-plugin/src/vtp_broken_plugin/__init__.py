"""Deliberately broken vtp_runtime plugins (see the README); importing the package is harmless."""
