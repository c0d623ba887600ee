"""Helpers for testing backends: the float64 reference, gloo rank pools, the conformance kit."""
