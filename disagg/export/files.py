"""Writing an export: the Secret's values, one YAML file per object, ``kustomization.yaml`` and the
``Dockerfile``.

The Secret's values (:func:`resolve_secrets`) come from the environment when set
(``DISAGG_ENGINE_KEY``, as ``disagg up`` takes it; ``DISAGG_KV_SECRET`` for the socket
connector), else from the ``secret.yaml`` a previous export left in the same directory (so that
exporting again rotates nothing), else they are drawn here (``secrets``). The proxy's API key is
the topology's ``proxy.api_key``. The values go into ``secret.yaml`` (mode 0600) and nowhere
else: callers print where each came from, never what it is.

``disagg.commands.export`` calls :func:`resolve_secrets`, then
:func:`disagg.export.k8s.build_manifests`, then :func:`write_export`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from disagg_connectors.socket_connector.auth import MIN_SECRET_BYTES

from disagg.errors import DeploymentError
from disagg.export.dockerfile import dockerfile
from disagg.export.k8s import Manifests, kustomization
from disagg.export.pods import ENGINE_KEY, KV_SECRET_KEY, PROXY_API_KEY, secret_envs
from disagg.proxy.config import ENGINE_KEY_ENV, check_key
from disagg.topology import Topology

SECRET_FILE = "secret.yaml"
#: the socket connector's shared secret, when the operator gives it (the engines' own variable)
KV_SECRET_ENV = "DISAGG_KV_SECRET"


def _previous(out_dir: Path) -> dict[str, str]:
    """The ``stringData`` of a previous export's Secret in ``out_dir`` (empty when there is none)."""
    path = out_dir / SECRET_FILE
    if not path.exists():
        return {}
    try:
        obj = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DeploymentError(f"{path}: cannot read the previous export's Secret ({type(exc).__name__}); "
                              "remove it to draw new keys") from None
    data = obj.get("stringData") if isinstance(obj, dict) else None
    if not isinstance(data, dict):
        raise DeploymentError(f"{path}: not a Secret with stringData; remove it to draw new keys")
    return {str(k): v for k, v in data.items() if isinstance(v, str)}


def resolve_secrets(topo: Topology, out_dir: Path,
                    environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The Secret's values and, per key, where each came from (for the command's report)."""
    env = os.environ if environ is None else environ
    previous = _previous(out_dir)
    values: dict[str, str] = {}
    origins: dict[str, str] = {}

    def take(key: str, variable: str, draw: str) -> None:
        if env.get(variable):
            values[key], origins[key] = env[variable], f"from ${variable}"
        elif previous.get(key):
            values[key], origins[key] = previous[key], f"kept from {out_dir / SECRET_FILE}"
        else:
            values[key], origins[key] = draw, "generated"

    take(ENGINE_KEY, ENGINE_KEY_ENV, secrets.token_urlsafe(32))
    check_key(values[ENGINE_KEY], f"the engine key ({origins[ENGINE_KEY]})")
    if secret_envs(topo):
        take(KV_SECRET_KEY, KV_SECRET_ENV, secrets.token_hex(32))
        kv = values[KV_SECRET_KEY]
        if len(kv.encode()) < MIN_SECRET_BYTES or not kv.isprintable() or any(c.isspace() for c in kv):
            raise DeploymentError(f"the KV connector's secret ({origins[KV_SECRET_KEY]}) must be at least "
                                  f"{MIN_SECRET_BYTES} printable characters without spaces")
    if topo.proxy.api_key:
        values[PROXY_API_KEY], origins[PROXY_API_KEY] = topo.proxy.api_key, "the topology's proxy.api_key"
    return values, origins


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper without anchors: objects share label dicts, which a reader should see
    written out where they are used."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(obj: dict[str, Any], header: str) -> str:
    """One object as YAML under a comment ``header``."""
    body = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)
    return f"# {header}\n{body}"


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)   # an existing file keeps its mode through O_CREAT


def write_export(out_dir: Path, manifests: Manifests, source: str) -> list[Path]:
    """Write every object, ``kustomization.yaml`` and the ``Dockerfile`` into ``out_dir``; returns
    the paths written. Raises DeploymentError when the directory cannot be written."""
    header = f"written by `disagg export k8s {source}`"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for m in manifests.objects:
            path = out_dir / m.file
            _write(path, to_yaml(m.obj, header), 0o600 if m.file == SECRET_FILE else 0o644)
            written.append(path)
        path = out_dir / "kustomization.yaml"
        _write(path, to_yaml(kustomization(manifests), header))
        written.append(path)
        path = out_dir / "Dockerfile"
        _write(path, dockerfile(manifests, source))
        written.append(path)
    except OSError as exc:
        raise DeploymentError(f"cannot write the export into {out_dir}: {exc.strerror or exc}") from None
    return written
