"""The loss-scaler state machine, step by step, and against torch.amp.GradScaler's update rule.

Bit for bit throughout: a scale is an fp32 number multiplied by the same factors in the same
order on both sides (each product one correctly rounded operation, the same on every machine),
and the rest is counting."""

from __future__ import annotations

import random

import pytest
import torch

from fastpar.amp import ConstantLossScaler, DynamicLossScaler, LossScaleError


def test_megatron_defaults():
    s = DynamicLossScaler()
    assert s.scale.item() == 2.0**32 and s.scale.dtype == torch.float32
    assert (s.min_scale, s.growth_factor, s.backoff_factor) == (1.0, 2.0, 0.5)
    assert (s.growth_interval, s.hysteresis) == (1000, 2)


def test_hysteresis_then_backoff_step_by_step():
    s = DynamicLossScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    trace = []
    for inf in [True, True, True, False, False, False, True, False, False, False]:
        s.update(inf)
        trace.append(s.scale.item())
    # 1st overflow uses hysteresis (no back-off); 2nd and 3rd back off; 3 clean steps grow and
    # restore hysteresis, so the next single overflow is absorbed again
    assert trace == [1024, 512, 256, 256, 256, 512, 512, 512, 512, 1024]


def test_clean_steps_do_not_restore_hysteresis_until_growth():
    s = DynamicLossScaler(initial_scale=64.0, growth_interval=4, hysteresis=2)
    s.update(True)  # hysteresis 2 -> 1, no back-off
    s.update(False)
    s.update(False)
    s.update(True)  # hysteresis 1 -> 0: back off (the clean steps did not restore it)
    assert s.scale.item() == 32.0
    # an overflow in the middle of a window resets the growth count
    for _ in range(3):
        s.update(False)
    s.update(True)
    for _ in range(3):
        s.update(False)
    assert s.scale.item() == 16.0  # one more back-off (hysteresis still used up), no growth yet
    s.update(False)  # 4th clean step in a row: grow, restore hysteresis
    assert s.scale.item() == 32.0
    s.update(True)  # absorbed by the restored hysteresis
    assert s.scale.item() == 32.0


def test_min_scale_floor_and_policies():
    s = DynamicLossScaler(initial_scale=4.0, min_scale=1.0, hysteresis=1, on_min_scale="ignore")
    for _ in range(5):
        s.update(True)
    assert s.scale.item() == 1.0
    s = DynamicLossScaler(initial_scale=2.0, min_scale=1.0, hysteresis=1)
    s.update(True)  # 2 -> 1, fine
    with pytest.raises(
        LossScaleError, match=r"overflowed with the loss scale already at min_scale=1\.0"
    ):
        s.update(True)
    s = DynamicLossScaler(initial_scale=1.0, min_scale=1.0, hysteresis=1, on_min_scale="warn")
    with pytest.warns(RuntimeWarning, match="already at min_scale"):
        s.update(True)
    s.update(True)  # warns once only
    assert s.scale.item() == 1.0


def test_update_accepts_tensors_and_checks_them():
    s = DynamicLossScaler(initial_scale=8.0, hysteresis=1)
    s.update(torch.tensor(1.0))
    assert s.scale.item() == 4.0
    s.update(torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"0-dim tensor, got shape \(2,\)"):
        s.update(torch.zeros(2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(initial_scale=0.5, min_scale=1.0), "need initial_scale >= min_scale > 0"),
        (dict(growth_factor=1.0), "growth_factor must be > 1"),
        (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
        (dict(hysteresis=0), "must be >= 1"),
        (dict(on_min_scale="explode"), "on_min_scale must be"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


def test_matches_grad_scaler_rule_with_hysteresis_one():
    """With hysteresis 1 the rule is GradScaler's: compare with torch's own update kernel."""
    rng = random.Random(0)
    ours = DynamicLossScaler(
        initial_scale=2.0**16, min_scale=1e-30, growth_interval=5, hysteresis=1
    )
    scale = torch.tensor(2.0**16)
    tracker = torch.tensor(0, dtype=torch.int32)
    for _ in range(300):
        inf = rng.random() < 0.15
        ours.update(inf)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(inf)), 2.0, 0.5, 5)
        assert ours.scale.item() == scale.item()


def test_state_dict_round_trip():
    a = DynamicLossScaler(initial_scale=256.0, growth_interval=3)
    for inf in (True, False, False):
        a.update(inf)
    b = DynamicLossScaler(growth_interval=3)
    b.load_state_dict(a.state_dict())
    for inf in (False, True, True, False):
        a.update(inf)
        b.update(inf)
        assert a.scale.item() == b.scale.item()
    c = ConstantLossScaler(128.0)
    c.update(True)
    assert c.scale.item() == 128.0 and c.inv_scale.item() == 1 / 128
    with pytest.raises(ValueError, match="scale must be positive"):
        ConstantLossScaler(0.0)


FP32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("growth_factor,start", [(2.0, 2.0**16), (3.0, 1.0)])
def test_a_long_clean_streak_stops_at_the_largest_finite_scale(growth_factor, start):
    """growth_interval=1 and 300 clean steps: the scale climbs to the last finite multiple
    (2^127; 3^80 for growth 3, since 3^81 > fp32 max) and stays there, step for step with
    torch's own update kernel (which refuses a growth to inf)."""
    ours = DynamicLossScaler(
        initial_scale=start, growth_factor=growth_factor, growth_interval=1, hysteresis=1
    )
    scale = torch.tensor(start)
    tracker = torch.tensor(0, dtype=torch.int32)
    for _ in range(300):
        ours.update(False)
        torch._amp_update_scale_(scale, tracker, torch.tensor(0.0), growth_factor, 0.5, 1)
        assert ours.scale.item() == scale.item()
    top = 2.0**127 if growth_factor == 2.0 else float(torch.tensor(3.0, dtype=torch.float64) ** 80)
    assert torch.isfinite(ours.scale)
    assert ours.scale.item() == pytest.approx(top, rel=1e-6)
    assert ours.scale.item() * growth_factor > FP32_MAX  # one more growth would be inf


def test_backs_off_after_an_overflow_at_the_limit():
    s = DynamicLossScaler(initial_scale=2.0**120, growth_interval=2, hysteresis=2)
    for _ in range(40):
        s.update(False)
    assert s.scale.item() == 2.0**127
    s.update(True)  # absorbed by hysteresis
    assert s.scale.item() == 2.0**127
    s.update(True)
    assert s.scale.item() == 2.0**126
    s.update(True)
    assert s.scale.item() == 2.0**125
    for _ in range(6):  # grows back to the limit and no further
        s.update(False)
    assert s.scale.item() == 2.0**127


def test_scales_must_be_finite_in_fp32():
    for bad in (float("inf"), 1e39, float("nan")):  # 1e39 is inf once stored as fp32
        with pytest.raises(ValueError, match=r"initial_scale must be positive and finite in fp32"):
            DynamicLossScaler(initial_scale=bad)
        with pytest.raises(ValueError, match=r"min_scale must be positive and finite in fp32"):
            DynamicLossScaler(min_scale=bad)
        with pytest.raises(ValueError, match=r"^scale must be positive and finite in fp32"):
            ConstantLossScaler(bad)
    DynamicLossScaler(initial_scale=FP32_MAX)  # the largest finite value itself is fine


def test_an_infinite_scale_from_a_checkpoint_comes_back_finite_and_backs_off():
    """A checkpoint of a scaler that had grown to inf (before the limit existed)."""
    state = DynamicLossScaler(hysteresis=1).state_dict()
    state["scale"] = torch.tensor(float("inf"))
    s = DynamicLossScaler(hysteresis=1)
    with pytest.warns(RuntimeWarning, match=r"loaded loss scale is inf; using 1\.7014e\+38"):
        s.load_state_dict(state)
    assert s.scale.item() == 2.0**127
    s.update(True)
    assert s.scale.item() == 2.0**126
    for bad in (float("nan"), 0.0, -4.0):
        state["scale"] = torch.tensor(bad)
        with pytest.raises(ValueError, match="the loaded loss scale must be positive and finite"):
            s.load_state_dict(state)
    with pytest.raises(ValueError, match="the loaded loss scale must be positive and finite"):
        ConstantLossScaler(4.0).load_state_dict({"scale": float("nan")})


@pytest.mark.parametrize("start", [2.0**40, 1e12, 5000.0, 4096.0, 3.0])
@pytest.mark.parametrize("hysteresis, backoff", [(2, 0.5), (1, 0.5), (3, 0.25)])
@pytest.mark.parametrize("used", [0, 1])
def test_overflows_to_counts_the_steps_the_scaler_really_takes(start, hysteresis, backoff, used):
    """``overflows_to(4096)`` against the state machine itself: after that many overflows the
    scale is at or below 4096, one fewer and it is not (none where it starts there)."""
    scaler = DynamicLossScaler(initial_scale=start, hysteresis=hysteresis, backoff_factor=backoff)
    for _ in range(used):  # a state part-way: hysteresis spent, the scale maybe lower
        scaler.update(True)
    n = scaler.overflows_to(4096.0)
    before = scaler.state_dict()
    taken = 0
    while float(scaler.scale) > 4096.0:
        scaler.update(True)
        taken += 1
    assert n == taken, (n, taken)
    scaler.load_state_dict(before)
    assert scaler.overflows_to(float(scaler.scale)) == 0


def test_overflows_to_the_floor_counts_the_floor_as_reached():
    scaler = DynamicLossScaler(initial_scale=64.0, min_scale=8.0, hysteresis=1)
    assert scaler.overflows_to(1.0) == 3  # 64 -> 32 -> 16 -> 8, the floor
