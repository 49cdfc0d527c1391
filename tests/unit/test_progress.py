"""The global-step progress bar outside a kernel: a tqdm bar on stdout, lines printed above it."""

from pscluster.cluster.progress import StepProgress


def test_terminal_progress_bar(capsys):
    bar = StepProgress(10, "run-7")
    bar.update(4)
    bar.write("[worker:0] After 4 training steps (4 global steps), loss 1.000")
    bar.update(10, force=True)
    bar.close()
    out = capsys.readouterr().out
    assert "[worker:0] After 4 training steps" in out
    assert "run-7: 100%" in out and "10/10" in out
