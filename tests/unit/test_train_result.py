"""The last line of `meshtrain train` (TrainResult.outcome): the losses with the evaluation they come from, and why
the last iteration has none, never a NaN standing in for a loss nobody computed."""

from pathlib import Path

from meshtrain.train.result import TrainResult

ROW = {"train_loss": 3.69124, "val_loss": 3.70564}


def result(iterations: int, evaluated_at: int | None = None, **fields) -> TrainResult:
    done = TrainResult(run_dir=Path("run"), iterations=iterations, **fields)
    if evaluated_at is not None:
        done.evaluated(evaluated_at, ROW)
    return done


def test_a_run_evaluated_at_its_last_iteration_gives_those_losses():
    assert result(30, 30).outcome() == "30 iterations, train loss 3.6912, val loss 3.7056"


def test_a_preempted_run_names_its_last_evaluation():
    assert result(16, 10, preempted=True).outcome() == (
        "16 iterations; iteration 16 was not evaluated (stopped by a signal: no time for an evaluation): the last "
        "evaluation, at iteration 10: train loss 3.6912, val loss 3.7056")


def test_a_start_with_nothing_left_to_train_gives_its_checkpoints_losses():
    assert result(30, 30, resumed_at=30).outcome() == (
        "30 iterations, all of them before this start (it resumed the checkpoint of iteration 30, the run's last: "
        "nothing was left to train), train loss 3.6912, val loss 3.7056")
    assert result(20, 20, resumed_at=20, preempted=True).outcome() == (
        "20 iterations, all of them before this start (stopped by a signal before its first iteration), train loss "
        "3.6912, val loss 3.7056")


def test_a_run_never_evaluated_says_so():
    assert result(16).outcome() == "16 iterations; not evaluated (no evaluation in this run yet)"
    no_val = result(5)
    no_val.evaluated(5, {"avg_loss": 2.5})
    assert no_val.outcome() == "5 iterations, train loss 2.5000"
