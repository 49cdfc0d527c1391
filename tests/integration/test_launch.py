"""``pscluster launch``: the run options on its command line, exit statuses that are the run's, and the tasks it
starts again or ends (a lost ps or worker, the chief lost, launch itself killed). Every task a real process."""

import json
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

import pscluster
from pscluster.__main__ import main as command
from pscluster.runtime.network import free_port
from pscluster.runtime.client import PSClient
from pscluster.runtime.protocol import Op
from pscluster.runtime.standalone import held_runs
from pscluster.spec import ClusterSpec, TaskSpec

from .launched import LOOP, PROGRESS, Launched, Process, gone_within

pytestmark = pytest.mark.integration


@pytest.fixture
def launch(tmp_path):
    """``launch(script_text, *flags, args=())``: a ``Launched`` of that script, stopped after the test."""
    started = []

    def start(text: str, *flags: str, args=()) -> Launched:
        script = tmp_path / f"job{len(started)}.py"
        script.write_text(text)
        started.append(Launched(tmp_path / "home", script, *flags, args=args))
        return started[-1]

    yield start
    for launched in started:
        launched.stop()


def loop_args(how: str, **init_options) -> tuple[str, str]:
    return how, json.dumps(init_options)


def job_store(job: Launched) -> str:
    return str(job.home / "runs.sqlite")


def test_run_options_on_the_command_line_go_under_init_s_own_arguments(launch):
    job = launch(LOOP, "--workers", "1", "--mode", "async", "--seed", "3", "--steps", "12",
                 args=loop_args("stop", seed=5))
    assert job.wait() == 0, job.output[-3000:]
    chief = job.summaries()[0]
    # --mode and --steps over the table's defaults; the script's own seed=5 over --seed 3
    assert (chief["mode"], chief["steps"], chief["seed"], chief["status"]) == ("async", 12, 5, "finished"), chief
    assert "[worker:0] pscluster.init(seed=5) overrides pscluster launch's --seed 3" in job.output, job.output


def test_a_bad_option_value_is_one_line_before_any_task_starts(tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text("open('ran', 'w')\n")
    for flag, value in [("--mode", "fast"), ("--steps", "0"), ("--max-restarts", "-1")]:
        assert command(["launch", flag, value, str(script)]) == 2
        shown = capsys.readouterr()
        assert shown.out == "" and len(shown.err.splitlines()) == 1 and flag in shown.err, (flag, shown)
    assert not (tmp_path / "ran").exists() and not (Path.cwd() / "ran").exists()
    with pytest.raises(SystemExit):
        command(["launch", "--help"])
    shown = capsys.readouterr().out
    assert all(flag in shown for flag in ("--mode", "--steps", "--staleness-bound", "--no-restore",
                                          "--max-restarts")), shown


def test_a_main_function_s_loop_that_ends_by_itself_finalizes_its_run(launch):
    """pytorch/examples' shape: the work in main(), the loop ends by itself, ctx.run never touched; the run is
    finalized before the interpreter's shutdown (concurrent.futures refuses work from then on)."""
    job = launch(LOOP, "--steps", "1000", args=loop_args("batches:8"))
    assert job.wait() == 0, job.output[-3000:]
    assert "could not be finalized" not in job.output and "Traceback" not in job.output, job.output[-3000:]
    run = pscluster.open_run("job0", store=job_store(job))
    assert run.status == "finished" and run.summary()["global_step"] == 8


def test_a_run_that_fails_fails_launch_and_the_script_s_process(launch):
    """The loop's own error fails the run (before: the script's exit ended the run as if its loop had returned,
    finished), at once; the chief's process and launch exit non-zero."""
    job = launch(LOOP, "--workers", "1", "--steps", "1000", args=loop_args("fail:0:3"))
    assert job.wait() != 0, job.output[-3000:]
    assert "worker 0's own error at its step 3" in job.output
    assert "[launch] the chief exited with status 1" in job.output, job.output[-3000:]
    run = pscluster.open_run("job0", store=job_store(job))
    events = run.events()
    [end] = events.query("kind == 'end'")["detail"]
    assert run.status == "failed" and "worker 0's own error at its step 3" in end["error"], end
    # its 3 steps, then no grace for a lost ps to show first: the supervisor asks the ps tasks (it waited 6 s more)
    training = events[events["detail"].map(lambda d: d.get("state") == "training")]["time"].min()
    assert events.query("kind == 'end'")["time"].max() - training < 5.0


def test_run_ended_escaping_the_script_is_the_loop_s_normal_end(launch):
    job = launch(LOOP, "--steps", "6", args=loop_args("run_ended"))
    assert job.wait() == 0, job.output[-3000:]
    said = [line for line in job.lines if "raised by the script" in line]
    assert len(said) == 2 and "Traceback" not in job.output, job.output[-3000:]  # one line a worker
    assert job.summaries()[0]["status"] == "finished"


# SIGKILL of launch, of the chief, of a ps and of another worker are rows of the fault matrix (make faults), in sync
# and async: here the signals launch passes on
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launch_ended_by_a_signal_leaves_no_task_running(launch, sig):
    """A loop without should_stop() trains on for ever: its tasks must end with launch. SIGTERM (passed on to the
    chief) stops the run cleanly, the chief ending by it; Ctrl-C (SIGINT, passed on to the workers) ends the run,
    recorded as interrupted."""
    job = launch(LOOP, "--steps", "1000000", "--log-every", "5", args=loop_args("forever"))
    job.wait_for(PROGRESS.format(index=1))
    tasks = job.pids
    assert len(tasks) == 3
    job.process.send_signal(sig)
    assert job.wait(60) == 128 + sig
    assert not gone_within(tasks, 5.0), job.output[-3000:]
    run = pscluster.open_run("job0", store=job_store(job))
    [end] = run.events().query("kind == 'end'")["detail"]
    if sig == signal.SIGTERM:
        assert run.status == "stopped", end
    else:
        assert run.status == "failed" and "worker 0 was interrupted (KeyboardInterrupt)" in end["error"], end


def test_a_ps_that_serves_no_run_gives_up(tmp_path):
    """A ps started again with nobody left (its chief gone) ends itself once nothing came for its bound; a ps
    asked in time goes on waiting for its run. A ps whose run's owner lets its lease lapse ends with status 1,
    saying so; renewed in time, it goes on serving."""
    (idle_spec, idle), (held_spec, held) = (_serving_ps(tmp_path, idle_s) for idle_s in (1.0, 600.0))
    try:
        answered = 0
        while answered < 8:  # 2 s, asked as often as a chief's supervisor asks a ps it waits for
            up = held_runs(idle_spec, timeout=5.0) is not None and held_runs(held_spec, timeout=5.0) is not None
            if up:
                with PSClient(held_spec, run_id=7, timeout=5.0) as client:  # as a chief's lease.hold_ps_tasks
                    client.request(Op.STATS, meta={"lease": {"owner": "the test", "seconds": 1.0}})
            answered += up
            assert idle.process.poll() is None and held.process.poll() is None, idle.output + held.output
            time.sleep(0.25)
        assert idle.wait(5.0) == 0 and held.wait(5.0) == 1, idle.output + held.output
    finally:
        idle.stop()
        held.stop()
    assert "ps 0 served no run and heard from nobody for 1s: ending" in idle.output, idle.output
    assert "ps 0 ends: run 7's owner (the test) has not renewed its lease for 1s" in held.output, held.output


def _serving_ps(home, idle_s: float) -> tuple[ClusterSpec, Process]:
    """A cluster of its own, and its ps task serving one run (``serve_run``) as a process."""
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=free_port()),), workers=(TaskSpec("worker", 0, port=0),))
    ps = Process([sys.executable, "-c", textwrap.dedent(f"""
        from pscluster.runtime import standalone
        from pscluster.spec import ClusterSpec
        spec = ClusterSpec.from_dict({spec.to_dict()!r})
        print(standalone.serve_run(spec, spec.task("ps", 0), idle_s={idle_s}))
    """)], home)
    return spec, ps
