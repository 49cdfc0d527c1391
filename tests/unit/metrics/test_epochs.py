"""A run's epochs in the words every view says them in."""

from pscluster.metrics.epochs import NAMED, progress, words


def test_one_epoch_for_all_each_worker_s_where_they_differ_a_range_for_many_and_none_without():
    assert words({0: 3, 1: 3}) == "epoch 3"
    assert words({1: 3, 0: 1}) == "worker 0 epoch 1, worker 1 epoch 3"
    assert words(dict.fromkeys(range(NAMED + 4), 2) | {5: 1, 7: 4}) == f"epochs 1 to 4 over {NAMED + 4} workers"
    assert words({}) == ""


def test_the_progress_says_the_epoch_then_the_global_step_and_its_target_when_there_is_one():
    assert progress(1234, None, {0: 3}) == "epoch 3 · global step 1234"
    assert progress(1234, 5000, {0: 3, 1: 3}) == "epoch 3 · global step 1234 / 5000"
    assert progress(12, None, {}) == "global step 12"
