"""Checks that repeat, with another configuration or mesh, what a shorter test of the default suite
already runs; they run with JAXMTP_LONG_TESTS=1, so that the default suite keeps to 15 minutes on
2 CPU cores."""

import os

import pytest

ON = bool(os.environ.get("JAXMTP_LONG_TESTS"))


def only_long(reason: str):
    """A mark that skips its test unless JAXMTP_LONG_TESTS is set; `reason` names what covers it."""
    return pytest.mark.skipif(not ON, reason=f"{reason}; set JAXMTP_LONG_TESTS=1 to run it")


def skip_unless_long(reason: str):
    """Skips the running test (a variant of a parametrized fixture) unless JAXMTP_LONG_TESTS is set."""
    if not ON:
        pytest.skip(f"{reason}; set JAXMTP_LONG_TESTS=1 to run it")
