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


def test_the_estimate_fits_a_line_so_short_prompts_do_not_overstate_a_long_ones_compute() -> None:
    est = ep.ComputeEstimate()
    assert est.predict(100) is None
    for n in (100, 400, 100, 400):                   # 30 ms fixed + 0.5 ms per token
        est.add(n, 0.03 + 0.0005 * n)
    assert est.predict(2000) == pytest.approx(1.03)
    same = ep.ComputeEstimate()
    same.add(8, 0.032)                               # one size only: seconds per token of those steps
    same.add(8, 0.032)
    assert same.predict(16) == pytest.approx(0.064)


def _learned(rate: float, tokens: int, compute: float) -> tuple[FakeClock, ep.StepHold]:
    """A StepHold that has measured one step of ``tokens`` prompt tokens taking ``compute`` seconds."""
    clock = FakeClock()
    hold = ep.StepHold(rate, clock=clock, sleep=clock.sleep)
    first = object()
    assert hold.started(first, {"warm": tokens}) == 0.0    # no estimate yet: nothing held before
    assert clock.slept == []
    clock.now += compute
    hold.hold(first)
    clock.slept.clear()
    return clock, hold


def test_the_first_step_is_held_only_after_its_forward() -> None:
    clock = FakeClock()
    hold = ep.StepHold(1000.0, clock=clock, sleep=clock.sleep)
    step = object()
    assert hold.started(step, {"r": 1000}) == 0.0 and clock.slept == []
    clock.now += 0.2
    assert hold.hold(step) == pytest.approx(0.8)
    assert hold.pre_held_s == 0.0 and hold.held_s == pytest.approx(0.8)
    assert hold.estimate.predict(1000) == pytest.approx(0.2)


def test_once_estimated_a_step_is_held_before_its_forward_so_its_work_ends_near_the_rate() -> None:
    clock, hold = _learned(1000.0, 1000, 0.2)        # 1,000 prompt tokens: 1 s at the rate, 0.2 s of compute
    step = object()
    scheduled = clock.now
    assert hold.started(step, {"r": 1000, "d": 1}) == pytest.approx(1.0 - 1.25 * 0.2)
    clock.now += 0.2                                 # the forward: a streamed KV leaves by its end
    forward_end = clock.now - scheduled
    assert 0.8 <= forward_end < 1.0
    assert hold.hold(step) == pytest.approx(1.0 - forward_end)
    assert clock.now - scheduled == pytest.approx(1.0)
    assert hold.pre_held_s == pytest.approx(0.75)


@pytest.mark.parametrize("compute", [0.1, 0.16, 0.2, 0.25, 0.6, 1.3])
def test_an_estimated_step_lasts_the_longer_of_its_compute_and_its_tokens_at_the_rate(compute: float) -> None:
    clock, hold = _learned(1000.0, 1000, 0.2)
    step = object()
    scheduled = clock.now
    pre = hold.started(step, {"r": 1000})
    clock.now += compute
    hold.hold(step)
    # within MARGIN x the estimate (0.25 s) exactly max(compute, 1 s); beyond it longer by the excess
    assert clock.now - scheduled == pytest.approx(max(compute, 1.0, pre + compute))
    if compute <= 1.25 * 0.2:
        assert clock.now - scheduled == pytest.approx(1.0)


def test_decode_only_steps_are_untouched_and_teach_the_estimate_nothing() -> None:
    clock, hold = _learned(1000.0, 1000, 0.2)
    decode = object()
    assert hold.started(decode, {"r1": 1, "r2": 1}) == 0.0
    clock.now += 0.05
    assert hold.hold(decode) == 0.0
    assert clock.slept == [] and hold.estimate.predict(1000) == pytest.approx(0.2)


def test_a_step_slower_than_the_rate_is_never_held_before_or_after() -> None:
    clock, hold = _learned(10_000.0, 1000, 0.25)     # 0.1 s at the rate, 0.25 s of compute
    for compute in (0.25, 0.3):
        step = object()
        assert hold.started(step, {"r": 1000}) == 0.0
        clock.now += compute
        assert hold.hold(step) == 0.0
    assert clock.slept == [] and hold.held_s == 0.0


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


def test_the_wrapped_schedule_holds_a_prefill_step_before_returning_it() -> None:
    clock = FakeClock()
    cls = type("Sched", (RecordingScheduler,), {})
    ep.wrap_scheduler(cls, ep.StepHold(1000.0, clock=clock, sleep=clock.sleep))
    sched = cls(steps=[{"a": 1000}, {"a": 1000}, {"a": 1, "b": 1}])
    first = sched.schedule()
    assert clock.slept == []                         # nothing learned yet
    clock.now += 0.2
    sched.update_from_output(first, "m1")
    assert clock.slept == [pytest.approx(0.8)]
    second = sched.schedule()                        # learned 0.2 s: held 1 - 1.25 x 0.2 before the forward
    assert clock.slept == [pytest.approx(0.8), pytest.approx(0.75)]
    clock.now += 0.2
    sched.update_from_output(second, "m2")
    assert clock.slept == [pytest.approx(0.8), pytest.approx(0.75), pytest.approx(0.05)]
    decode = sched.schedule(throttle_prefills=True)
    sched.update_from_output(decode, "m3")
    assert len(clock.slept) == 3


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
    """One process (one import of vLLM): ``register`` without the variable leaves the real
    scheduler alone; with it, it wraps it."""
    code = ("import os\n"
            "from disagg_connectors.emulated_prefill import ENV, register\n"
            "from vllm.v1.core.sched.scheduler import Scheduler\n"
            "from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n"
            "def wrapped():\n"
            "    return [hasattr(Scheduler.schedule, '__wrapped__'),\n"
            "            hasattr(AsyncScheduler.update_from_output, '__wrapped__')]\n"
            "register()\n"
            "print(*wrapped())\n"
            "os.environ[ENV] = '2500'\n"
            "register()\n"
            "print(*wrapped())\n")
    env = {k: v for k, v in os.environ.items() if k != ep.ENV}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-2:] == ["False False", "True True"], done.stdout


def test_register_stops_the_process_on_a_bad_rate() -> None:
    bad = _register_in_subprocess("-3")
    assert bad.returncode != 0
    assert "DISAGG_EMULATED_PREFILL_RATE='-3'" in bad.stderr


def test_vllm_lists_the_plugin_among_its_general_plugins() -> None:
    from importlib.metadata import entry_points
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_emulated_prefill") == "disagg_connectors.emulated_prefill:register"
