"""Real small file systems for the tests of full, read-only and removed disks (tests and CI run as root)."""

import contextlib
import os
import subprocess
from pathlib import Path


@contextlib.contextmanager
def mounted(folder: Path, *, size: str | None = None, bind: Path | None = None):
    """``folder`` (made if need be) with a tmpfs of ``size`` (e.g. ``"2m"``) mounted on it, or the folder ``bind``
    bind-mounted there; unmounted on leaving."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(bind), str(folder)] if bind is not None else
                   ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(disk: Path, leave: int = 0) -> None:
    """The file system of ``disk`` filled up (a file ``filler`` there), then ``leave`` bytes of it given back."""
    with open(disk / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    os.truncate(disk / "filler", max(0, os.path.getsize(disk / "filler") - leave))
