"""kvwire: KV-cache events from inference engines to KV-aware routers."""

__version__ = "0.1.0"
