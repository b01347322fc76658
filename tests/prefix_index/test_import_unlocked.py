"""import_ranks runs without the GIL: the process's other threads run beside it (a router's
event loop beside its checkpoint's import), any other call on the same native index meanwhile
raises RuntimeError, and the errors met inside (bad views, memory) surface as before."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvwire.prefix_index import PrefixIndex, _core

from .test_rank_view import pack, records, signed

BS = 16


def build(ranks: int, blocks: int, shared: int) -> tuple[PrefixIndex, list[bytes]]:
    """Ranks of `blocks` blocks each, the first `shared` of them one chain all ranks hold (pool
    rows), and each rank's views."""
    src = PrefixIndex(BS)
    for r in range(ranks):
        src.add_rank("w", r)
    core, chain, root = src._core, src._scheme.native, src._scheme.root(None, None)
    common = np.arange(shared * BS, dtype=np.uint64)
    for r in range(ranks):
        own = np.arange((blocks - shared) * BS, dtype=np.uint64) + np.uint64((r + 1) << 40)
        hashes = [(r << 32) + i + 1 for i in range(blocks)]
        tokens = np.concatenate([common, own])
        assert (
            core.store(src._sids[("w", r)], chain, hashes, None, tokens, False, root, None, 0) == 0
        )
    return src, [src.export_rank("w", r) for r in range(ranks)]


def tokens_of(rank: int, blocks: int, shared: int) -> list[int]:
    own = [t + ((rank + 1) << 40) for t in range((blocks - shared) * BS)]
    return list(range(shared * BS)) + own


@pytest.fixture(scope="module")
def big() -> tuple[PrefixIndex, list[bytes]]:
    return build(8, 20_000, 500)


@pytest.fixture
def no_alloc_limit() -> Iterator[None]:
    yield
    _core._fail_allocs(-1)


def test_other_threads_run_during_an_import_and_calls_on_its_index_are_refused(
    big: tuple[PrefixIndex, list[bytes]],
) -> None:
    _, views = big
    core = _core.Index.__new__(_core.Index)  # valid before __init__ too
    sids = list(range(len(views)))
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("nodes", lambda: core.nodes),
        ("memory", lambda: core.memory),
        ("rank_stats", lambda: core.rank_stats(0)),
        ("export_rank", lambda: core.export_rank(None)),
        ("import_ranks", lambda: core.import_ranks([], [])),
        ("match_list", lambda: core.match_list([])),
        ("blocks", lambda: core.blocks(0)),
        ("__init__", lambda: core.__init__()),
    ]
    started, done = threading.Event(), threading.Event()
    loops = [0]  # the other thread's progress while it saw the import running
    refused: set[str] = set()

    def other() -> None:
        started.set()
        i = 0
        while not done.is_set():
            name, call = calls[i % len(calls)]
            i += 1
            try:
                call()
            except RuntimeError as exc:
                assert "importing" in str(exc)
                refused.add(name)
                loops[0] += 1
            except (ValueError, IndexError):
                pass  # before the first import; match_list on an index never configured

    t = threading.Thread(target=other, daemon=True)
    t.start()
    assert started.wait(10)
    try:
        for _ in range(50):  # an import takes tens of ms; the other thread's calls land in it
            assert core.import_ranks(sids, views) == [0] * len(views)
            if len(refused) == len(calls) and loops[0] > 100:
                break
    finally:
        done.set()
        t.join(10)
    assert refused == {name for name, _ in calls}
    assert loops[0] > 100
    # Not disturbed: the index holds exactly the views.
    assert [core.export_rank(s) for s in sids] == views


def test_an_import_does_not_start_beside_a_call_under_way() -> None:
    """A call that lets Python code run midway (a holder name's __hash__) is counted: an
    import of the same index started from that code is refused (it would change the tables
    under the call), and a plain call from it is not."""
    src, views = build(2, 100, 10)
    core = src._core
    seen: list[str] = []

    class Name:
        def __hash__(self) -> int:
            assert core.rank_stats(0)[0] == 100
            try:
                core.import_ranks([1], [views[0]])
            except RuntimeError as exc:
                seen.append(str(exc))
            return 1

    found = core.match(src.keys(tokens_of(0, 100, 10)), [Name(), Name()], None)
    assert seen == ["another call on this prefix index is under way (a concurrent import)"] * 2
    assert sorted(found.values()) == [10, 100]
    assert [core.export_rank(s) for s in (0, 1)] == views  # rank 1 not replaced
    assert core.import_ranks([1], [views[0]]) == [0]  # once the call is over


def test_a_prefix_index_call_from_another_thread_waits_for_the_import(
    big: tuple[PrefixIndex, list[bytes]],
) -> None:
    src, views = big
    dst = PrefixIndex(BS)
    started = threading.Event()
    got: list[Any] = []
    probe = tokens_of(3, 20_000, 500)[: 600 * BS]

    def other() -> None:
        started.set()
        got.append(dst.match(probe))  # takes the index's lock: after the import, never inside it

    dst._lock.acquire()
    try:
        t = threading.Thread(target=other, daemon=True)
        t.start()
        assert started.wait(10)
    finally:
        dst._lock.release()
    dst.import_ranks([("w", r, v) for r, v in enumerate(views)])
    t.join(10)
    assert len(got) == 1
    assert got[0] in ({}, src.match(probe))  # before the import, or after it whole
    assert (
        dst.match(probe) == src.match(probe) == {("w", r): 500 for r in range(8)} | {("w", 3): 600}
    )


def test_a_bad_view_found_without_the_gil_raises_its_value_error(
    big: tuple[PrefixIndex, list[bytes]],
) -> None:
    src, views = big
    small = src.export_rank("w", 0)[: 24 + 32 * 50]
    base = bytes(small)
    recs = records(signed(pack(base, records(base)[:50])))
    twice = signed(pack(base, [*recs[:49], recs[0]]))
    padded = signed(pack(base, [*recs[:49], {**recs[49], "pad": 1}]))
    corrupt = bytearray(views[2])
    corrupt[24 + 32 * 7 + 3] ^= 1
    cases = [
        (twice, f"holds engine hash {recs[0]['h']} twice"),
        (padded, "padding is not zero"),
        (bytes(corrupt), "checksum does not match"),
        (b"KVIX" + bytes(10), "shorter than its 24-byte header"),
    ]
    dst = PrefixIndex(BS)
    dst.import_ranks([("w", 0, views[0])])
    before = dst.export_rank("w", 0)
    for view, why in cases:
        with pytest.raises(ValueError) as err:
            dst.import_ranks([("w", 0, views[0]), ("w", 1, views[1]), ("w", 2, view)])
        assert why in err.value.args[0] and err.value.args[1] == 2
        with pytest.raises(ValueError, match=why) as one:
            dst.import_rank("w", 5, view)
        assert len(one.value.args) == 1
        assert dst.ranks() == [("w", 0)] and dst.export_rank("w", 0) == before
    capped = PrefixIndex(BS, max_blocks_per_rank=100)
    with pytest.raises(ValueError, match="past this index's max_blocks_per_rank"):
        capped.import_ranks([("w", 0, views[0])])


@pytest.mark.usefixtures("no_alloc_limit")
def test_memory_errors_inside_the_import_leave_the_index_usable() -> None:
    src, views = build(4, 3_000, 200)
    other = PrefixIndex(BS)
    other.import_ranks([("x", 0, views[3])])
    want_other = other.export_rank("x", 0)
    failures = 0
    for n in range(400):
        dst = PrefixIndex(BS)
        dst.import_ranks([("x", 0, views[3]), ("w", 1, views[0])])
        _core._fail_allocs(n)
        try:
            dst.import_ranks([("w", r, v) for r, v in enumerate(views)])
        except MemoryError:
            failures += 1
            _core._fail_allocs(-1)
            # The ranks of the call cleared (PrefixIndex does), the others as they were.
            assert dst.export_rank("x", 0) == want_other
            assert dst.rank_blocks("w", 1) == 0
            dst.import_ranks([("w", r, v) for r, v in enumerate(views)])
        else:
            _core._fail_allocs(-1)
            break
        finally:
            _core._fail_allocs(-1)
        assert [dst.export_rank("w", r) for r in range(4)] == views
        probe = tokens_of(2, 3_000, 200)
        assert dst.match(probe) == {**src.match(probe), ("x", 0): 200}  # x holds rank 3's view
    else:
        pytest.fail("the import never got all the memory it asked for")
    assert failures >= 5
    assert [dst.export_rank("w", r) for r in range(4)] == views
