"""Training scripts as their authors write them, each beside its pscluster version: the tests run both and count the
lines that differ."""
