"""The publisher tests' socket fixtures, shared with the reference engine's tests."""

from tests.publisher.conftest import ipc_dir, zctx

__all__ = ["ipc_dir", "zctx"]
