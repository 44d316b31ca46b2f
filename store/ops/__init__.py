"""What the store does with its chunks: writes and rewrites, reads and lookups, eviction and
compaction, pins, namespaces, and recovery. Each part is built with its collaborators by the
facade (``store/store.py``)."""
