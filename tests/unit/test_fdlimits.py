"""node/fdlimits.py: the listen backlog leaves the reserve room for the sockets a connection flood holds
beyond the serving budget (tests/integration/test_attack_connections.py floods a coordinator at 512)."""
import subprocess
import sys

import pytest

from tests.integration.coordinator_harness import REPO

PROBE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[1])))
from node import fdlimits as F
print(F.raise_open_file_limit(), F.serving_budget().limit, F.listen_backlog())
"""


@pytest.mark.parametrize("limit", [256, 512, 1024, 4096, 16384])  # at most the hard limit here (20,000)
def test_accept_bursts_fit_in_the_reserve(limit):
    """A fresh process under each hard limit (the serving budget is per process): ACCEPT_TURNS backlogs of
    uncounted sockets plus OTHER_FDS fit in what the serving budget leaves free; large limits keep 128."""
    from node.fdlimits import ACCEPT_TURNS, MAX_BACKLOG, OTHER_FDS

    out = subprocess.run([sys.executable, "-c", PROBE, str(limit)], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    got, budget, backlog = map(int, out.stdout.split())
    assert got == limit and budget == limit // 2
    assert 1 <= backlog <= MAX_BACKLOG
    assert budget + ACCEPT_TURNS * backlog + OTHER_FDS <= limit, (budget, backlog)
    if limit >= 4096:
        assert backlog == MAX_BACKLOG
