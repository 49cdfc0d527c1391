"""What the control plane runs on an engine: a remote engine ends itself once its controller is gone."""

import socket
import subprocess
import sys
import textwrap
import time

DEADLINE_S, PERIOD_S = 1.0, 0.1


def test_a_remote_engine_ends_once_its_controller_accepts_no_connection_for_the_deadline():
    listener = socket.create_server(("127.0.0.1", 0))  # the controller's registration port
    port = listener.getsockname()[1]
    engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pscluster.runtime.remote import watch_controller
        watch_controller("127.0.0.1", {port}, {DEADLINE_S}, period_s={PERIOD_S})
        print("watching", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline() == "watching\n"
        time.sleep(3 * DEADLINE_S)  # its controller answers: it serves on
        assert engine.poll() is None, "the engine ended while its controller answered"
        listener.close()
        closed = time.monotonic()
        assert engine.wait(60) == 3
        # its last connection was accepted at most a period before the close
        assert time.monotonic() - closed >= DEADLINE_S - PERIOD_S
    finally:
        engine.kill()
        listener.close()
