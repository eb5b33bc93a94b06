"""The one ``ssh`` command line: how disagg reaches a remote host of a topology.

Callers: :mod:`disagg.launch.processes` (start, watch and stop engines) and
:mod:`disagg.probe` (``disagg probe-link``'s remote agent) both build their ssh
argv here, so a host that ``disagg up`` reaches is reached the same way by
``probe-link``.

OpenSSH keeps the first value given for an option. The host's own
``ssh_options`` therefore come first, so a topology can change the defaults
here (``ConnectTimeout``, ``StrictHostKeyChecking``, ``LogLevel``), except
``BatchMode=yes``, which always comes first: keys only, never a password prompt.
"""

from __future__ import annotations

import os

from disagg.errors import LaunchError
from disagg.topology import HostSpec

#: seconds ssh waits for the TCP connection (a host's ssh_options may say otherwise)
CONNECT_TIMEOUT_S = 10
#: ssh options of every call, after the host's own
DEFAULT_OPTIONS = (f"ConnectTimeout={CONNECT_TIMEOUT_S}", "StrictHostKeyChecking=accept-new", "LogLevel=ERROR")


def ssh_prefix(host: HostSpec) -> list[str]:
    """``ssh -o BatchMode=yes [host options] [defaults] [-p port] [-i key] target``; append a command."""
    if host.ssh is None:
        raise LaunchError(f"host {host.name} is reached without ssh")
    argv = ["ssh", "-o", "BatchMode=yes"]
    for option in (*host.ssh_options, *DEFAULT_OPTIONS):
        argv += ["-o", option]
    if host.ssh_port:
        argv += ["-p", str(host.ssh_port)]
    if host.ssh_key:
        argv += ["-i", os.path.expanduser(host.ssh_key)]
    return [*argv, host.ssh]
