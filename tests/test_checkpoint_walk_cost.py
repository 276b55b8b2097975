"""What a reader's own walks of a checkpoint cost: less than torch's unpickling of it, linearly.

Found by the outside attack: a ``.pt`` whose meta dict was built by a million
``SETITEMS`` (a 4 MB pickle) took ``checkpoint_meta`` about 7 s -- the opcode
walk (:mod:`ddpctx.checkpoint.claims`) and the value walk
(:mod:`ddpctx.checkpoint.shape`) each cost about as much as torch's unpickling,
and the file was read twice, once to choose it and once for its meta. The
costs are compared as ratios measured in one run, in CPU seconds (absolute
times move by half on this shared machine), with bounds far from both the
measured values and the old ones (``benchmarks/bench_readers.py`` measures
them at full size; BENCHMARKS.md).
"""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path

import pytest

from benchmarks import bench_readers
from ddpctx.checkpoint.claims import check_pickle
from ddpctx.checkpoint.files import RefusedCheckpoint

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # about 10 s of unpickling, 3 rounds of two files
def test_a_readers_walks_cost_less_than_torchs_unpickling_and_grow_linearly(
    tmp_path: Path,
) -> None:
    small = bench_readers.setitems_pt(tmp_path / "checkpoint-000001.pt", 100_000)
    large = bench_readers.setitems_pt(tmp_path / "checkpoint-000002.pt", 200_000)
    found = bench_readers.measure([small, large], rounds=3)
    for times in found.values():
        walks = bench_readers.ratio(times, "opcode walk") + bench_readers.ratio(times, "value walk")
        # measured 0.2-0.25x; before, 1.8-2.2x (each walk about as much as torch's unpickling)
        assert walks <= 1.0, times
        # measured 1.2-1.4x (torch.load, the walks, checksums); before, 4-4.5x (read twice)
        assert bench_readers.ratio(times, "checkpoint_meta") <= 2.0, times
    before, after = bench_readers.best(found[small]), bench_readers.best(found[large])
    for step in ("opcode walk", "value walk"):  # linear: 2x; quadratic: 4x
        assert after[step] / before[step] <= 3.0, (step, before, after)


def test_one_long_list_passed_to_call_after_call_is_refused_in_linear_time() -> None:
    # Each call's arguments are weighed (a size's ints): the same memoized list of 50,000
    # ints handed to 50,000 calls was 2.5 * 10^9 steps of the opcode walk (hours), where
    # torch refuses the first call or builds each once.
    ones = b"]q\x00(" + b"K\x01" * 50_000 + b"e"  # a list of ones, memo 0
    callee = b"c__builtin__\nbytearray\nq\x010"  # the global, memo 1
    calls = b"h\x01h\x00\x85R0" * 50_000  # bytearray(the list), popped
    data = b"\x80\x02" + ones + callee + calls + b"N."
    with pytest.raises(RefusedCheckpoint, match="the same long list passed to call after call"):
        check_pickle(data, len(data), Path("a.pt"))


def test_a_pickle_the_walk_reads_is_walked_to_its_stop_as_pickletools_reads_it() -> None:
    # Every opcode is read as pickletools reads it: the walk ends where the pickle does.
    from ddpctx.checkpoint.opwalk import OPAQUE, walk

    class Nothing:
        def call(self, callee: object, args: object) -> object:
            return OPAQUE

        def storage(self, pid: object) -> object:
            return OPAQUE

    values = [
        {"a": [1, 2.5, None, True, (1, 2, 3), b"xy", "é" * 300, 2**70, -5, 70000]},
        bytearray(b"ab"),
        frozenset({1}),
        {1, 2},
    ]
    for protocol in range(6):
        for value in values:
            data = pickle.dumps(value, protocol=protocol) + b"after"
            assert walk(data, Nothing(), 0) == len(data) - len(b"after"), (protocol, value)
    stream = io.BytesIO()
    pickle.Pickler(stream, protocol=0).dump({"k": [1, "s", 2.0]})
    assert walk(stream.getvalue(), Nothing(), 0) == len(stream.getvalue())
    with pytest.raises(ValueError, match="past the pickle's end"):
        walk(b"\x80\x02X" + struct.pack("<I", 1 << 30) + b"abc.", Nothing(), 0)
