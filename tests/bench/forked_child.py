"""A child for ``test_zygote.py``: prints what it runs with as a JSON line, then echoes each line of its stdin
upper-cased, then says goodbye on stderr and exits with CODE ("raise": an uncaught exception).

    python -m tests.bench.forked_child CODE
"""

import json
import os
import sys

import torch

if __name__ == "__main__":
    print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "mark": os.environ.get("MARK"),
                      "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        print(line.strip().upper(), flush=True)
    print("goodbye", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise RuntimeError("the child broke")
    sys.exit(int(sys.argv[1]))
