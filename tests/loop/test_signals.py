"""Stop signals in one process (flexengine/loop/signals.py): the first SIGINT/SIGTERM asks the loop to stop after
its step, a second only says the save goes on, a third hands the signal to the handler that was there before; the
old handlers come back afterwards."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

from flexengine.loop.signals import StopSignals


def _signals(step: int = 4) -> StopSignals:
    return StopSignals(torch.device("cpu"), lambda: step)


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)  # Python runs the handler before the next line of this thread


def test_a_signal_asks_to_stop_after_the_step_and_names_it(caplog):
    caplog.set_level(logging.WARNING, logger="flexengine.loop.signals")
    stop = _signals(step=4)
    assert not stop.should_stop() and not stop.requested()
    with stop.handle():
        _send(signal.SIGTERM)
        assert stop.signal == signal.SIGTERM and stop.count == 1
    assert stop.should_stop() and stop.requested()  # without a process group: this process's own signal
    assert f"signal {int(signal.SIGTERM)}: finishing step 5, then saving and exiting with status 143" in caplog.text


@pytest.mark.parametrize(("activity", "unit"), [("evaluation", "batch"), ("sampling", "token")])
def test_a_signal_during_a_pause_stops_it_at_its_next_unit(caplog, activity, unit):
    caplog.set_level(logging.WARNING, logger="flexengine.loop.signals")
    stop = _signals()
    with stop.handle(), stop.pausing(activity):
        assert stop.pause == activity
        _send(signal.SIGINT)
    assert stop.pause is None and f"stopping the {activity} at its next {unit}" in caplog.text


def test_the_third_signal_gives_up_to_the_previous_handler_and_all_come_back(caplog):
    caplog.set_level(logging.WARNING, logger="flexengine.loop.signals")
    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        stop = _signals(step=9)
        with stop.handle():
            with stop.handle():  # nested (run_training holds it over the loop and the summary): one handler
                _send(signal.SIGTERM)
                _send(signal.SIGTERM)
                assert seen == []  # the first two are ours
                _send(signal.SIGTERM)
                assert seen == [signal.SIGTERM]  # the third reached the handler that was there before
            assert stop.handling  # the inner exit left the outer in charge
        assert "again: still finishing and saving (step 9)" in caplog.text and "a third time: aborting" in caplog.text
        _send(signal.SIGTERM)  # after handle(): the previous handler is back
        assert seen == [signal.SIGTERM, signal.SIGTERM] and stop.count == 3
    finally:
        signal.signal(signal.SIGTERM, before)


def test_handlers_are_restored_on_leaving():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = _signals()
    with stop.handle():
        assert signal.getsignal(signal.SIGTERM) not in before
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert not stop.should_stop()  # no signal came


@pytest.mark.parametrize(
    ("completes_run", "said"),
    [
        (False, "signal 15: finishing the checkpoint save of step 3, then exiting with status 143"),
        (True, "signal 15: finishing the final save (step 3); the run has done all its steps, so it ends complete"),
    ],
)
def test_a_signal_during_a_save_names_the_save_and_its_exit_status(caplog, completes_run, said):
    """Before: "finishing step 4, then saving and exiting with status 143" for a step that never runs, and the
    same during a finished run's final save, which then exited 0."""
    caplog.set_level(logging.WARNING, logger="flexengine.loop.signals")
    stop = _signals(step=3)
    with stop.handle(), stop.saving(3, completes_run=completes_run):
        _send(signal.SIGTERM)
    assert said in caplog.text and "step 4" not in caplog.text
    assert stop.saving_step is None and not stop.save_completes_run  # the mark ends with the save
