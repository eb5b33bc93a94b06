"""Scheduling for pytest-xdist (``make test-fast`` runs ``-n 4``): every test is a unit of its own,
as with ``--dist load``, except that all of tests/net is one unit, run on one worker one test
after another, since its tests share fixed addresses (198.18.5.0/24, 198.18.20.0/24) and sshd
set-ups. (The ``xdist_group`` marker would say this, but pytest-xdist 3.8 cannot tag the node
ids of pytest 9, so ``--dist loadgroup`` runs them anywhere.) tests/conftest.py installs it."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

#: node-id prefixes whose tests run together, on one worker, in collection order
TOGETHER = ("tests/net/",)


class NetTogether(LoadScopeScheduling):
    """``--dist loadscope`` whose scope is the test itself, or the prefix in :data:`TOGETHER`."""

    def _split_scope(self, nodeid: str) -> str:
        return next((prefix for prefix in TOGETHER if nodeid.startswith(prefix)), nodeid)
