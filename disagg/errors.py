"""Every error disagg raises on purpose, in one tree.

::

    DisaggError                     base: cli.py prints str(exc) and exits 2
    ├── TopologyError               bad topology YAML: file:line: field: message
    │   └── TopologyErrors          several of them, from one file (ErrorSink)
    ├── DeploymentError             a valid topology that cannot be turned into
    │                               engine commands (e.g. an engine/connector pair
    │                               not supported)
    ├── PlanError                   `disagg plan` cannot price a topology (a link
    │                               or device it knows no figures for)
    ├── ModelError                  model directory missing or unreadable
    ├── LaunchError                 starting, probing or stopping engines
    │   ├── PortInUseError          a port the topology needs is already taken
    │   ├── EngineStartError        an engine died or never became healthy;
    │   │                           names host, port and the tail of its log
    │   └── RemoteCommandError      an SSH command failed
    │       └── HostUnreachableError ssh itself failed: what runs there is unknown
    ├── StateError                  the run-state file is missing or corrupt
    │   └── NotRunningError         no run to act on (``down`` says so and exits 0)
    ├── LinkError                   emulating (namespaces, veth, tc) or probing
    │                               a link failed; names the command and why
    └── ProxyError                  the proxy cannot serve (no healthy backend...)

Low-level exceptions (OSError, yaml.YAMLError, aiohttp.ClientError,
subprocess.CalledProcessError) are mapped to these at the module that touches
them, with ``raise ... from exc``. Library code never calls ``sys.exit``; only
``cli.py`` turns a ``DisaggError`` into an exit status and one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class DisaggError(Exception):
    """Base of every error disagg raises deliberately."""


class TopologyError(DisaggError):
    """A topology file is invalid; the message names file, line and field."""

    def __init__(self, file: str, line: int | None, field: str, message: str) -> None:
        self.file = file
        self.line = line
        self.field = field
        self.message = message
        where = f"{file}:{line}" if line is not None else file
        prefix = f"{where}: {field}: " if field else f"{where}: "
        super().__init__(prefix + message)


class TopologyErrors(TopologyError):
    """Every error found in one topology file, each with its file:line (``errors``, in file order).

    Its own file, line, field and message are the first error's, so code that reads one error
    still can; ``str()`` lists them all, one per line."""

    errors: list[TopologyError]

    def __init__(self, errors: list[TopologyError]) -> None:
        flat = [e for err in errors for e in (err.errors if isinstance(err, TopologyErrors) else [err])]
        self.errors = sorted(flat, key=lambda e: (e.file, e.line or 0))
        first = self.errors[0]
        super().__init__(first.file, first.line, first.field, first.message)
        self.args = (f"{first.file}: {len(self.errors)} errors:\n"
                     + "\n".join(f"  {e}" for e in self.errors),)

    def __str__(self) -> str:
        return str(self.args[0])


class ErrorSink:
    """Collects the :class:`TopologyError` of several independent checks, so that one run reports
    every error of a file (``disagg.topology.build_topology``, ``disagg.deployment``)."""

    def __init__(self) -> None:
        self.errors: list[TopologyError] = []

    def attempt(self, check: Callable[[], T]) -> T | None:
        """``check()``'s value, or None after recording the TopologyError it raised."""
        try:
            return check()
        except TopologyError as exc:
            self.errors.append(exc)
            return None

    def add(self, error: TopologyError) -> None:
        self.errors.append(error)

    def raise_if_any(self) -> None:
        """Raise what was collected: the one error itself, or :class:`TopologyErrors`."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise TopologyErrors(self.errors)


class DeploymentError(DisaggError):
    """A topology is well formed but cannot be turned into engine commands (``build_deployment``)."""


class PlanError(DisaggError):
    """``disagg plan`` cannot price a topology (a link or device it knows no figures for)."""


class ModelError(DisaggError):
    """A model directory or config cannot be used."""


class LaunchError(DisaggError):
    """Starting, probing or stopping engine processes failed."""


class PortInUseError(LaunchError):
    """A port that the topology needs is already bound by another process."""


class EngineStartError(LaunchError):
    """An engine exited or did not become healthy in time."""

    def __init__(self, name: str, host: str, port: int, reason: str, log_tail: str) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.reason = reason
        self.log_tail = log_tail
        body = f"{name} on {host}:{port} {reason}"
        if log_tail.strip():
            body += "\n--- last lines of its log ---\n" + log_tail.rstrip()
        super().__init__(body)


class RemoteCommandError(LaunchError):
    """A command run over SSH failed."""


class HostUnreachableError(RemoteCommandError):
    """ssh itself failed (exit 255, or no answer in time): what runs on the host is unknown."""


class StateError(DisaggError):
    """The run-state file is missing, unreadable or from another topology."""


class NotRunningError(StateError):
    """Nothing is running where a run was looked for (no state file)."""


class LinkError(DisaggError):
    """Setting up an emulated link or measuring a link failed."""


class ProxyError(DisaggError):
    """The proxy cannot be configured or cannot serve."""
