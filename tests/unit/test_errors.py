"""What the engines show of pscluster's errors."""

import traceback

import pytest

from pscluster.errors import PeerLost, RunFault, RunOver, StaleTask, TrainingError


@pytest.mark.parametrize("error", [PeerLost, StaleTask, RunOver])
def test_a_run_fault_renders_its_traceback_plainly(error):
    # IPython takes _render_traceback_ over its own formatting, which parsed the source of every frame: the
    # engine of a worker that lost its ps spent 0.4-0.8 s on it, and its next attempt waited
    try:
        raise error("ps 1 at tcp://127.0.0.1:5000 disconnected during PUSH_PULL: it was lost")
    except RunFault as e:
        shown = e._render_traceback_()
        assert shown == "".join(traceback.format_exception(e)).splitlines()
    assert shown[0] == "Traceback (most recent call last):"
    assert shown[-1] == f"pscluster.errors.{error.__name__}: ps 1 at tcp://127.0.0.1:5000 disconnected during " \
                        "PUSH_PULL: it was lost"
    assert any(__file__ in line for line in shown)  # where it was raised


def test_a_worker_s_own_training_error_keeps_ipython_s_traceback():
    # the user's errors are shown with their source lines, as IPython formats them (see user_traceback)
    assert not hasattr(TrainingError("a NaN loss"), "_render_traceback_")
