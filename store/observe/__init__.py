"""What the store tells others about itself beyond its chunks: what engines announced to
routers (``announce``), why a lookup misses (``explain``), and its figures and advice for
operators (``report``)."""
