"""The emulated-prefill plugin: which steps it holds, for how long, and how it loads.

The hold logic runs against a recording scheduler and a fake clock; :func:`register` runs in a
subprocess against the installed vLLM's real scheduler class (the wrap must not leak into this
process). The e2e side (an engine's prefill rate measured back) is in tests/e2e/test_emulated_link.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
from disagg_connectors import emulated_prefill as ep


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_prompt_tokens_counts_only_requests_scheduled_more_than_one_token() -> None:
    assert ep.prompt_tokens({"a": 512, "b": 1, "c": 1, "d": 30}) == 542
    assert ep.prompt_tokens({"a": 1, "b": 1}) == 0
    assert ep.prompt_tokens({}) == 0


@pytest.mark.parametrize("text", ["0", "-5", "nan", "inf", "fast", ""])
def test_parse_rate_refuses_what_is_not_a_positive_number(text: str) -> None:
    with pytest.raises(ValueError):
        ep.parse_rate(text)


def test_a_prefill_step_lasts_its_tokens_at_the_rate_and_decode_steps_are_not_held() -> None:
    clock = FakeClock()
    hold = ep.StepHold(1000.0, clock=clock, sleep=clock.sleep)
    prefill, decode = object(), object()
    hold.started(prefill, {"r1": 400, "r2": 1})      # 400 prompt tokens: 0.4 s at 1,000 tokens/s
    clock.now += 0.1                                 # the real step took 0.1 s
    assert hold.hold(prefill) == pytest.approx(0.3)
    hold.started(decode, {"r1": 1, "r2": 1})
    clock.now += 0.02
    assert hold.hold(decode) == 0.0
    assert clock.slept == [pytest.approx(0.3)]
    assert hold.tokens == 400 and hold.held_s == pytest.approx(0.3)


def test_a_machine_slower_than_the_rate_is_never_held() -> None:
    clock = FakeClock()
    hold = ep.StepHold(10_000.0, clock=clock, sleep=clock.sleep)
    step = object()
    hold.started(step, {"r": 1000})                  # 0.1 s at the rate
    clock.now += 0.25                                # the real step took longer
    assert hold.hold(step) == 0.0 and clock.slept == []


@dataclass
class Output:
    num_scheduled_tokens: dict[str, int]


@dataclass
class RecordingScheduler:
    """Stands in for vLLM's Scheduler: hands out the next step, records the outputs it is given."""

    steps: list[dict[str, int]]
    seen: list[tuple[Any, Any]] = field(default_factory=list)

    def schedule(self, throttle_prefills: bool = False) -> Output:
        return Output(self.steps.pop(0))

    def update_from_output(self, scheduler_output: Output, model_output: Any) -> str:
        self.seen.append((scheduler_output, model_output))
        return "outputs"


def test_wrapped_scheduler_holds_between_schedule_and_update_and_passes_everything_through() -> None:
    clock = FakeClock()
    cls = type("Sched", (RecordingScheduler,), {})
    ep.wrap_scheduler(cls, ep.StepHold(2000.0, clock=clock, sleep=clock.sleep))
    ep.wrap_scheduler(cls, ep.StepHold(1.0, clock=clock, sleep=clock.sleep))   # a second register: no-op
    sched = cls(steps=[{"a": 1000}, {"a": 1}])
    out = sched.schedule()
    assert sched.update_from_output(out, "model") == "outputs"
    assert clock.slept == [pytest.approx(0.5)]
    out2 = sched.schedule(throttle_prefills=True)
    sched.update_from_output(out2, "model2")
    assert clock.slept == [pytest.approx(0.5)]
    assert sched.seen == [(out, "model"), (out2, "model2")]


def _register_in_subprocess(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ep.ENV}
    if value is not None:
        env[ep.ENV] = value
    code = ("from disagg_connectors.emulated_prefill import register\n"
            "register()\n"
            "from vllm.v1.core.sched.scheduler import Scheduler\n"
            "from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n"
            "print(hasattr(Scheduler.schedule, '__wrapped__'), "
            "hasattr(AsyncScheduler.update_from_output, '__wrapped__'))\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.engine
def test_register_wraps_the_real_vllm_scheduler_only_when_the_variable_is_set() -> None:
    on = _register_in_subprocess("2500")
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout.split() == ["True", "True"]
    off = _register_in_subprocess(None)
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.split() == ["False", "False"]


def test_register_stops_the_process_on_a_bad_rate() -> None:
    bad = _register_in_subprocess("-3")
    assert bad.returncode != 0
    assert "DISAGG_EMULATED_PREFILL_RATE='-3'" in bad.stderr


def test_vllm_lists_the_plugin_among_its_general_plugins() -> None:
    from importlib.metadata import entry_points
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_emulated_prefill") == "disagg_connectors.emulated_prefill:register"
