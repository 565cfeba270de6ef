from pathlib import Path

import pytest

from supervisor.checkpoint.layout import TrialLayout
from supervisor.control.freq import FreqCtl
from supervisor.control.step_info import StepInfo


def fire_steps(ctl: FreqCtl, n: int, steps_per_epoch: int, secs: float = 1.0) -> list[int]:
    return [g for g in range(n) if ctl.check(epoch_end=(g % steps_per_epoch == steps_per_epoch - 1), elapsed_secs=secs)]


def test_every_n_steps():
    assert fire_steps(FreqCtl(freq_steps=5), 12, 100) == [4, 9]


def test_every_epoch_and_every_two_epochs():
    assert fire_steps(FreqCtl(freq_epochs=1), 12, 4) == [3, 7, 11]
    assert fire_steps(FreqCtl(freq_epochs=2), 12, 4) == [7]


def test_every_n_seconds():
    assert fire_steps(FreqCtl(freq_secs=2.5), 6, 100, secs=1.0) == [2, 5]


def test_any_condition_fires_and_each_keeps_its_own_schedule():
    assert fire_steps(FreqCtl(freq_steps=5, freq_epochs=1), 24, 12) == [4, 9, 11, 14, 19, 23]
    assert fire_steps(FreqCtl(freq_steps=4, freq_secs=2.5), 8, 100) == [2, 3, 5, 7]


def test_nothing_set_never_fires():
    assert fire_steps(FreqCtl(), 50, 5) == []


def test_state_round_trip_continues_the_same_schedule():
    a = FreqCtl(freq_steps=4)
    fire_steps(a, 6, 100)
    b = FreqCtl(freq_steps=4)
    b.load_state_dict(a.state_dict())
    assert [a.check(False, 1), a.check(False, 1)] == [b.check(False, 1), b.check(False, 1)] == [False, True]


def test_config_frequency_wins_over_the_saved_one():
    saved = FreqCtl(freq_steps=10)
    fire_steps(saved, 3, 100)
    resumed = FreqCtl(freq_steps=2)  # the user changed freq_steps before resuming
    resumed.load_state_dict(saved.state_dict())
    assert "freq_steps" not in saved.state_dict()
    assert resumed.check(False, 1) is True


def test_old_state_without_keys_loads_with_defaults():
    ctl = FreqCtl(freq_steps=2)
    ctl.load_state_dict({})
    assert ctl.state_dict() == {"epochs_since": 0, "steps_since": 0, "secs_since": 0.0}


def test_step_info_next_rolls_over_epochs():
    s = StepInfo.before_start(steps_per_epoch=3)
    seen = []
    for _ in range(7):
        s = s.next()
        seen.append((s.epoch, s.epoch_step, s.global_step))
    assert seen == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4), (1, 2, 5), (2, 0, 6)]


def test_resume_at_epoch_boundary_starts_the_next_epoch():
    last = StepInfo(epoch=0, epoch_step=2, global_step=2, steps_per_epoch=3)
    assert last.is_epoch_end
    assert last.next() == StepInfo(1, 0, 3, 3)
    assert StepInfo.from_dict(last.to_dict()) == last


def test_layout_paths_follow_the_design():
    lay = TrialLayout(Path("/r"), "u", "exp", "t0")
    assert lay.checkpoint_root == Path("/r/checkpoints/u/exp/t0")
    assert lay.export_dir(1, 2, 14) == Path("/r/checkpoints/u/exp/t0/default/epoch1epochstep2globalstep14")
    assert lay.recover_checkpoint == Path("/r/checkpoints/u/exp/t0/default/recover_checkpoint")
    assert lay.recover_info == Path("/r/checkpoints/u/exp/t0/recover_info")
    assert lay.stats_log == Path("/r/logs/u/exp/t0/stats.jsonl")
    assert lay.events_log == Path("/r/logs/u/exp/t0/events.jsonl")
    assert lay.recover_state_paths() == [lay.recover_info, lay.recover_checkpoint, lay.recover_checkpoint_of("critic")]


def test_layout_refuses_traversal():
    with pytest.raises(ValueError):
        _ = TrialLayout(Path("/r"), "u", "..", "t0").checkpoint_root
