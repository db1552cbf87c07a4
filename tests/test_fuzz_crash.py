"""The mutation fuzzer of hostile input, run in subprocesses (issue 18): mutated patches (``coo``,
``flat``, ``ctx``; raw and zstd), bucket streams, handshake metadata, wire frames and checkpoint
files, fed to the receiving code. A crash (a segfault in a kernel, an abort) ends the child, not
pytest, and fails the test with its output; every numba kernel runs with bounds checks
(``NUMBA_BOUNDSCHECK=1``, compiled afresh in an empty cache), so an index out of range raises
instead of reading or writing past an array.

The properties: every payload is refused with one of aiosync's own errors or accepted; a
refused one changed nothing, an accepted one gave exactly the genuine weights (patches and
buckets carry checksums here); the sender never answers ``ok`` to metadata it then fails on.

CI runs a bounded number of examples per target; ``AIOSYNC_FUZZ_EXAMPLES=20000`` (and
``AIOSYNC_FUZZ_SEED``) run a longer campaign.
"""

from __future__ import annotations

import os

from test_hostile import child

EXAMPLES = int(os.environ.get("AIOSYNC_FUZZ_EXAMPLES", "60"))
SEED = int(os.environ.get("AIOSYNC_FUZZ_SEED", "0"))


def test_hostile_payloads_never_crash_and_never_write_garbage_with_bounds_checked_kernels(tmp_path):
    timeout = max(600, EXAMPLES * 2)
    result = child("fuzz", "all", str(EXAMPLES), str(SEED), timeout=timeout,
                   env={"NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path / "numba")})
    assert result.pop("boundscheck") is True
    assert set(result) == {"patch", "bucket", "frame", "handshake", "checkpoint"}
    for target, counts in result.items():
        assert not counts["bad"], f"{target}: {counts['bad'][:5]}"
        assert counts["refused"] + counts["accepted"] == EXAMPLES, (target, counts)
        assert counts["refused"] > 0, f"{target}: no mutation was refused (the fuzzer mutates nothing?)"
