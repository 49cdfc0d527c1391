"""pscluster's benchmark suite: ``make bench`` (``python -m benchmarks.run``); see README.md."""
