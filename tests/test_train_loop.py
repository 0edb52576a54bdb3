"""The training loop's divergence watch (``fastpar.train.loop.Divergence``): how skipped steps
are counted against --max-skipped-steps, fed the records a run makes."""

from __future__ import annotations

from fastpar.amp import DynamicLossScaler
from fastpar.train import TrainConfig
from fastpar.train.loop import Divergence


class _Trainer:
    def __init__(self, start: float) -> None:
        self.scaler = DynamicLossScaler(initial_scale=start)


def _stop(start: float, skipped: int, clean_first: bool = False, max_skipped: int = 3):
    """The first step at which ``Divergence`` stops a run whose steps all skip (after one clean
    step with ``clean_first``), with its message; the scaler updated as the trainer does."""
    cfg = TrainConfig.from_flags(precision="fp16", loss_scale=start, max_skipped_steps=max_skipped)
    trainer = _Trainer(start)
    watch = Divergence(cfg, trainer)
    for step in range(1, skipped + 1):
        skip = not (clean_first and step == 1)
        trainer.scaler.update(skip)
        stop = watch.scan([{"step": step, "skipped": skip, "loss": 1.0}])
        if stop is not None:
            return step, stop.message
    return None, ""


def test_the_back_off_from_a_large_start_is_not_counted_as_skipped_steps():
    """--max-skipped-steps counts from where a run at the default start (4096) would be: from
    2^40, 29 steps of back-off (1 of hysteresis + 28 halvings) come first."""
    assert _stop(4096.0, 50)[0] == 3  # the default start: unchanged
    step, text = _stop(2.0**40, 50)
    assert step == 29 + 3, text
    assert "backs off from its start --loss-scale 1.09951e+12" in text
    assert "its first 29 skipped steps, the back-off to 4096, not counted" in text
    # after a clean step the streak is divergence, whatever the start
    step, text = _stop(2.0**40, 50, clean_first=True)
    assert step == 1 + 3 and "diverged at step 4: 3 steps in a row" in text, text
