"""Watching a running topology: ``disagg top`` and ``disagg logs`` (a docstring only).

- :mod:`disagg.watch.metrics`: Prometheus text parsed once, the sums and buckets a view reads,
  and the sample names a text exports (what the dashboard test checks queries against);
- :mod:`disagg.watch.snapshot`: a snapshot of the run from scrapes (pure: unit-tested on
  captured metrics text);
- :mod:`disagg.watch.scrape`: one scrape of the proxy's and every engine's ``/metrics`` and
  ``/health``;
- :mod:`disagg.watch.render`: the snapshot as terminal lines;
- :mod:`disagg.watch.top`: the refresh loop and ``--once``;
- :mod:`disagg.watch.logs`: the logs of a run's processes, local or over SSH, once or followed.
"""
