"""The reference engine: a paged KV cache per rank, a control protocol and a server.

Not something an engine embeds: the demo, the end-to-end tests and the
benchmarks drive it to exercise :mod:`kvwire.publisher` as a real engine
would. ``PagedKVCache`` needs the ``engine`` extra (torch).
"""

from kvwire.reference.paged_cache import AdmitResult, CacheFullError, PagedKVCache, block_hashes

__all__ = ["AdmitResult", "CacheFullError", "PagedKVCache", "block_hashes"]
