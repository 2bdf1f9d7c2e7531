"""PyTorch tools for tests, benchmarks and training, outside the runtime package: the
reference model of clover-spec sections 1-3 and 5 (``reference.model``) and the random HF
checkpoint generator (``reference.checkpoint``). Importable once ``tests/`` is on sys.path
(tests/conftest.py puts it there; bench scripts insert it themselves)."""
