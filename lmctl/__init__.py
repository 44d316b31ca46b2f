"""lmctl: the cache-manager daemon and operator CLI. Never imports torch or vllm."""

__version__ = "0.1.0"
