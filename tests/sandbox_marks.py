"""``needs_os``: skip a test that executes generated code where OS isolation (bubblewrap namespaces) does not work,
unless ``JF_REQUIRE_SANDBOX`` is set (``.ci/run`` sets it, so CI fails instead of skipping)."""
import os

import pytest

from megatron_jf.eval.sandbox import isolation_status

WHY = isolation_status()
needs_os = pytest.mark.skipif(WHY is not None and not os.environ.get("JF_REQUIRE_SANDBOX"),
                              reason=f"OS isolation unavailable here: {WHY}")
