"""Shared by the sandbox tests: ``require_bwrap()`` skips a test where bubblewrap is unavailable, with the
reason, except where the escape suite must run (``CI`` or ``RLBITS_REQUIRE_BWRAP`` set, as ``.ci/run`` does):
there it fails."""

from __future__ import annotations

import os

import pytest

from rlbits.envs.sandbox import SandboxUnavailableError, check_sandbox


def require_bwrap() -> None:
    try:
        check_sandbox("bwrap")
    except SandboxUnavailableError as e:
        if os.environ.get("CI") or os.environ.get("RLBITS_REQUIRE_BWRAP"):
            pytest.fail(f"CI must run the sandbox tests under bubblewrap (.ci/run installs it): {e}")
        pytest.skip(str(e))
