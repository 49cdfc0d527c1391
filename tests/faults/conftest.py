"""The fault matrix runs with ``make faults`` (PSCLUSTER_FAULT_MATRIX=1), not in ``make test``: see its module."""
