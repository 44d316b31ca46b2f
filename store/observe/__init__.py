"""What the store tells others about itself beyond its chunks: what engines announced to
routers (``announce``) and why a lookup misses (``explain``)."""
