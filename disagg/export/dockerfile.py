"""The ``Dockerfile`` beside exported objects: the images they name that upstream does not publish.

Target ``proxy`` (always): disagg itself on a slim Python, for ``python3 -m disagg proxy``.
Target ``engine`` (only when the engines need ``disagg_connectors``: the socket connector, see
:func:`disagg.export.pods.needs_connectors_image`): the upstream vLLM image with disagg's
``connectors/`` importable as ``disagg_connectors`` (vLLM loads the socket connector and the
engine guard from there); NIXL engines run the upstream image as it is.

Nothing here builds an image; :mod:`disagg.export.files` writes the text.
"""

from __future__ import annotations

from disagg.export.k8s import DEFAULT_VLLM_IMAGE, Manifests


def dockerfile(manifests: Manifests, source: str) -> str:
    """The Dockerfile's text for ``manifests`` exported from the topology file ``source``."""
    lines = [
        f"# Images for the objects exported from {source} (`disagg export k8s`).",
        "# Build from the root of the disagg repository (the context needs pyproject.toml, README.md,",
        "# disagg/ and connectors/), push where the cluster's nodes pull from, or pass",
        "# --image / --proxy-image to the export:",
        f"#   docker build -f <this file> --target proxy -t {manifests.proxy_image} .",
    ]
    if manifests.connectors_image:
        lines.append(f"#   docker build -f <this file> --target engine -t {manifests.engine_image} .")
        lines += [
            "",
            f"ARG VLLM_IMAGE={DEFAULT_VLLM_IMAGE}",
            "",
            "# engine: upstream vLLM with disagg's connectors (the socket KV connector, the engine guard),",
            "# importable as disagg_connectors; nothing else of disagg",
            "FROM ${VLLM_IMAGE} AS engine",
            "COPY connectors /opt/disagg/disagg_connectors",
            "ENV PYTHONPATH=/opt/disagg${PYTHONPATH:+:${PYTHONPATH}}",
        ]
    lines += [
        "",
        "# proxy: disagg itself (the proxy needs neither vLLM nor a GPU)",
        "FROM python:3.11-slim AS proxy",
        "COPY pyproject.toml README.md /src/",
        "COPY disagg /src/disagg",
        "COPY connectors /src/connectors",
        "RUN pip install --no-cache-dir /src && rm -rf /src",
        "USER 65534:65534",
        "",
    ]
    return "\n".join(lines)
