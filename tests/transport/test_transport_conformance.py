"""Runs the shared Link conformance suite (conformance.py) against every implementation."""

from conformance import *  # noqa: F403
