"""engine_main: local engines wait for their controller's own connection file, complete, never a stale one."""

import json
import os
import threading
import time

import pytest

from pscluster.cluster.engine_main import command, connection_info


def test_a_stale_or_half_written_connection_file_is_waited_out(tmp_path):
    path = tmp_path / "ipcontroller-x-engine.json"
    path.write_text(json.dumps({"registration": 1}))  # an earlier controller's, left behind
    os.utime(path, (time.time() - 60, time.time() - 60))
    since = time.time()

    def controller_writes():
        time.sleep(0.2)
        path.write_text('{"registration": ')  # caught while being written
        time.sleep(0.2)
        path.write_text(json.dumps({"registration": 2}))
    writer = threading.Thread(target=controller_writes)
    writer.start()
    try:
        assert connection_info(str(path), since, timeout=30) == {"registration": 2}
    finally:
        writer.join()


def test_no_connection_file_ends_the_engine_naming_the_file(tmp_path):
    missing = str(tmp_path / "none.json")
    with pytest.raises(SystemExit, match="no connection file .*none.json"):
        connection_info(missing, 0.0, timeout=0.2)
    assert command(3, missing, 1.5)[-3:] == ["3", missing, "1.5"]
