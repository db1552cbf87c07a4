"""No per-element refcounting in the numba kernels' loops.

numba keeps arrays alive with atomic reference counts. Inside a kernel it prunes them, but
an inlined helper that takes an array and branches can leave an ``NRT_incref`` /
``NRT_decref`` pair *per call*: in the flat writer that made the whole write 2.6× slower
(``kernels.get_nibble`` / ``get_exception`` say how it was written instead). Nothing shows it
but the compiled code, so this test compiles the kernels afresh in a subprocess (numba's
cache keeps no IR to inspect) and reads their LLVM IR: no refcount call may sit on a cycle of
a per-element or per-change kernel's control flow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r'''
import importlib, json, re, sys
import numba
import numpy as np

def loop_refcounts(ir):
    """Refcount calls in basic blocks that lie on a cycle, summed over the module's functions."""
    total = 0
    for body in re.findall(r"^define [^\n]*\{\n.*?^\}", ir, re.S | re.M):
        blocks, cur = {}, "entry"
        for line in body.splitlines()[1:]:
            m = re.match(r'^"?([^\s":;][^":]*)"?:', line)
            if m:
                cur = m.group(1)
            blocks.setdefault(cur, []).append(line)
        succ = {b: set(re.findall(r'label %"?([^\s",\]]+)"?', "\n".join(ls))) for b, ls in blocks.items()}
        for b, ls in blocks.items():
            calls = sum(("@NRT_incref" in ln) + ("@NRT_decref" in ln) for ln in ls)
            if not calls:
                continue
            seen, todo = set(), list(succ[b])
            while todo:
                x = todo.pop()
                if x not in seen:
                    seen.add(x)
                    todo.extend(succ.get(x, ()))
            if b in seen:
                total += calls
    return total

# the known-bad pattern, as a control: the check must find its calls
@numba.njit(inline="always")
def _bad_helper(a, c, e):
    z = a[0, c]
    if z == 15:
        z = a[1, e]
        e += 1
    return z, e

@numba.njit
def bad(a, n):
    e = 0
    s = 0
    for i in range(n):
        z, e = _bad_helper(a, i, e)
        s += z
    return s

bad(np.zeros((2, 4), np.int64), 4)
out = {"control": loop_refcounts(bad.inspect_llvm(bad.signatures[0]))}

from aiosync.syncers.kernels_warmup import warm_up
warm_up((2,), ctx=True)
for mod, names in json.loads(sys.argv[1]).items():
    m = importlib.import_module("aiosync.syncers." + mod)
    for name in names:
        f = getattr(m, name)
        out[f"{mod}.{name}"] = [loop_refcounts(f.inspect_llvm(sig)) for sig in f.signatures]
print(json.dumps(out))
'''

#: The kernels whose loops run per element or per change (``encode_segment`` / ``decode_segment``
#: loop over classes and groups of blocks only, around the kernels listed here).
HOT = {
    "kernels": ["diff_update", "diff_encode_flat", "encode_flat", "pack_nibbles", "count_escapes", "decode_gaps"],
    "kernels_write": ["diff_positions", "scatter", "apply_flat_gaps_logged", "restore_gaps"],
    "kernels_ctx": ["diff_ctx", "count_symbols", "exp_histogram"],
    "kernels_ctx_coder": ["_encode_gaps", "_encode_values", "_decode_gaps", "_decode_values", "_positions",
                          "_value_tables", "write_codes", "restore_codes"],
}


def test_hot_kernel_loops_make_no_refcount_calls(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))  # an empty cache: everything compiles, IR kept
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(HOT)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found.pop("control") > 0, "the check no longer sees the refcount calls of the known-bad pattern"
    assert set(found) == {f"{m}.{n}" for m, names in HOT.items() for n in names}
    assert all(found.values()), f"kernels that warm_up did not compile: {[k for k, v in found.items() if not v]}"
    bad = {k: v for k, v in found.items() if any(v)}
    assert not bad, f"refcount calls inside the loops of {bad} (per element or change: see the module docstring)"
