"""``pscluster <command>`` (also ``python -m pscluster``): ``launch`` a script on a local cluster of processes."""

import sys

from .errors import PSClusterError

USAGE = "usage: pscluster launch [--ps N] [--workers N] [run options] script.py [args...]  (pscluster launch --help)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "launch":
        print(USAGE, file=sys.stderr)
        return 2
    from .launch import main as launch

    try:
        return launch(argv[1:])
    except PSClusterError as e:
        print(f"pscluster: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
