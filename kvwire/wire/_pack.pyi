"""Types of the native int packer (``_pack.c``)."""

from typing import Any

def pack_ints(values: Any, mode: int, what: str) -> bytes: ...
