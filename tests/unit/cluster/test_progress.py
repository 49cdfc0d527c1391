"""The global-step progress bar (outside a kernel: a tqdm bar on stdout, lines printed above it, at the rate
it is given; in a kernel: one line updated in place) and the line of a cluster's start."""

from pscluster.cluster import progress
from pscluster.cluster.progress import StepProgress


def test_terminal_progress_bar(capsys):
    bar = StepProgress(10, "run-7")
    bar.update(4, float("nan"))  # no rate yet
    bar.write("[worker:0] After 4 training steps (4 global steps), loss 1.000")
    bar.update(10, 271.5, force=True)
    bar.close()
    out = capsys.readouterr().out
    assert "[worker:0] After 4 training steps" in out
    assert "run-7: 100%" in out and "10/10" in out and "271.50step/s" in out


def test_kernel_progress_line_shows_the_rate_given_not_steps_over_its_own_age(monkeypatch):
    shown = []

    class Handle:
        def update(self, data, raw):
            shown.append(data["text/plain"])

    monkeypatch.setattr(progress, "in_kernel", lambda: True)
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: Handle())
    bar = progress.StepProgress(10_000, "run-8")
    bar.update(8_000, 271.0, force=True)  # a bar made when the run was at step 8000 already
    assert "8000/10000" in shown[-1] and "271.00step/s" in shown[-1] and "00:07" in shown[-1]  # 2000 steps left
    bar.update(8_100, float("nan"), force=True)
    assert "?step/s" in shown[-1]


def test_a_cluster_start_in_a_kernel_is_one_line_updated_in_place_at_each_new_stage(monkeypatch):
    shown = []

    class Handle:
        def update(self, data, raw):
            shown.append(data["text/plain"])

    monkeypatch.setattr(progress, "in_kernel", lambda: True)
    monkeypatch.setattr("IPython.display.display", lambda data, **k: shown.append(data["text/plain"]) or Handle())
    line = progress.StartProgress("c1: 1 ps + 2 workers on local engines")
    for stage in ("engines up 0 of 3", "engines up 0 of 3", "engines up 3 of 3", "ready"):
        line(stage)
    assert shown[0] == "c1: 1 ps + 2 workers on local engines: starting"
    assert [s.rsplit(" (", 1)[0] for s in shown[1:]] == [f"c1: 1 ps + 2 workers on local engines: {s}" for s in
                                                         ("engines up 0 of 3", "engines up 3 of 3", "ready")]
    assert all(s.endswith(" s)") for s in shown[1:])  # the seconds since the start began
