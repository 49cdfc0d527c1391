"""TensorBoard (the process %pscluster tensorboard starts) in headless chromium, on a run's event files."""

import pytest

from pscluster.metrics.tensorboard import EventWriter, run_logdir
from pscluster.tensorboard_server import TensorBoard

from .conftest import FAILURES

pytestmark = pytest.mark.browser


def test_tensorboard_draws_each_workers_loss_of_a_run(browser, tmp_path, request):
    writer = EventWriter(run_logdir(tmp_path / "runs.sqlite", "digits", 1))
    for i in range(1, 60):
        writer.add_events([{"kind": "step", "task": f"worker:{w}", "time": 1000.0 + i, "local_step": i,
                            "global_step": 2 * i + w, "loss": 2.0 / i, "accuracy": 0.5} for w in (0, 1)])
    writer.close()
    board = TensorBoard(tmp_path / "tensorboard").start()
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    try:
        page.goto(board.url)
        loss = page.locator("card-view", has=page.locator(".tag", has_text="loss"))
        loss.locator("canvas, svg").first.wait_for(timeout=60_000)  # the chart of the loss card is drawn
        assert page.locator(".tag").all_inner_texts() == ["accuracy", "loss"]
        runs = page.get_by_text("digits-1/worker_")
        assert set(runs.all_inner_texts()) == {"digits-1/worker_0", "digits-1/worker_1"}
    except Exception:
        FAILURES.mkdir(exist_ok=True)
        page.screenshot(path=str(FAILURES / f"{request.node.name}.png"))
        raise
    finally:
        context.close()
        board.stop()
    assert not board.running

