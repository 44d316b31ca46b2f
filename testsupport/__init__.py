"""What the tests, demos, benchmarks and the stress suite share to run the real parts: the
daemon and the ``lmctl`` command line (``lmctl.py``: in this process, or as a process where the
process itself is what is tested), redis-server (``redis.py``), ``vllm serve`` (``vllm.py``),
the connector's settings (``connector.py``) and free ports (``ports.py``).

A package of its own, so that nothing outside tests/ imports tests/; nothing here imports
pytest."""
