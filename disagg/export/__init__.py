"""``disagg export``: a topology as another system's configuration (a docstring only).

``k8s`` (Kubernetes manifests) is built in four steps, one module each:
``cluster`` decides whether a topology can run in a cluster and what of it has no meaning
there; ``pods`` turns each planned engine (``disagg.deployment``) and the proxy
(``disagg.launch.frontend``) into a container; ``k8s`` assembles the objects; ``files``
writes them with their secrets and the ``Dockerfile`` (``dockerfile``).
"""
