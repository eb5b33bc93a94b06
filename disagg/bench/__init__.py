"""``disagg bench``: a load generator for OpenAI-compatible endpoints and a
runner that compares topologies on the same workload.

Modules, one job each::

    records.py    what one request recorded (times, tokens, error)
    metrics.py    pure arithmetic: TTFT/TPOT/ITL/E2EL, percentiles, goodput
    slo.py        ``--slo ttft=2s,tpot=100ms`` -> SLO
    workload.py   prompt classes, arrival schedules (Poisson/gamma/closed loop)
    prompts.py    prompts of an exact token count (server /tokenize or estimate)
    client.py     one streaming request over aiohttp
    progress.py   a plain stderr progress bar
    runner.py     one run at one rate, and a rate sweep (with repeats)
    routes.py     the proxy's route mix and TTFT prediction error, from /metrics deltas
    report.py     JSON, Markdown tables, PNG plots from many runs (medians over repeats)
    prefill.py    measured prefill rate -> <run_dir>/measurements/prefill.json
    compare.py    up -> bench -> down for each topology (and routing policy), then one report
"""
