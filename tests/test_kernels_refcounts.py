"""No per-element refcounting in the numba kernels' loops.

numba keeps arrays alive with atomic reference counts. Inside a kernel it prunes them, but
with numba 0.68 an inlined helper that takes an array and branches leaves an ``NRT_incref`` /
``NRT_decref`` pair *per call* (0.65 pruned them): in the flat writer that made the whole
write 2.6× slower (``kernels.flat.get_nibble`` / ``get_exception`` say how it is written instead).
Nothing shows it but the compiled code, so this test compiles the kernels afresh in a
subprocess (numba's cache keeps no IR to inspect) and reads their LLVM IR: no refcount call
may sit on a cycle of a per-element or per-change kernel's control flow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

SCRIPT = r"""
import importlib, json, sys
from aiosync.syncers.kernels.warmup import warm_up
warm_up((2,), ctx=True)
out = {}
for mod, names in json.loads(sys.argv[1]).items():
    m = importlib.import_module("aiosync.syncers." + mod)
    for name in names:
        f = getattr(m, name)
        out[f"{mod}.{name}"] = [f.inspect_llvm(sig) for sig in f.signatures]
with open(sys.argv[2], "w") as fh:
    json.dump(out, fh)
"""


def loop_refcounts(ir: str) -> int:
    """Refcount calls (``NRT_incref`` / ``NRT_decref``) in the basic blocks of ``ir`` (LLVM IR
    text) that lie on a cycle of their function's control flow, summed over its functions."""
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
            total += calls if b in seen else 0
    return total


#: The control: two refcount calls in a loop, one after it (the kind numba 0.68 emits for an
#: inlined helper that takes an array and branches; numba 0.65 prunes them).
CONTROL = """
define void @f(i8* %m, i64 %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%j, %"loop.next"]
  call void @NRT_incref(i8* %m)
  br label %"loop.next"
"loop.next":
  call void @NRT_decref(i8* %m)
  %j = add i64 %i, 1
  %c = icmp slt i64 %j, %n
  br i1 %c, label %loop, label %exit
exit:
  call void @NRT_decref(i8* %m)
  ret void
}
"""


def test_the_check_finds_refcount_calls_in_loops_only():
    assert loop_refcounts(CONTROL) == 2
    assert loop_refcounts(CONTROL.replace("label %loop, label %exit", "label %exit, label %exit")) == 0


#: The kernels whose loops run per element or per change (``encode_segment`` / ``decode_segment``
#: loop over classes and groups of blocks only, around the kernels listed here).
HOT = {
    "kernels.flat": ["diff_update", "diff_encode_flat", "encode_flat", "pack_nibbles", "count_escapes", "decode_gaps"],
    "kernels.write": ["diff_positions", "scatter", "apply_flat_gaps_logged", "restore_gaps"],
    "kernels.ctx": ["diff_ctx", "count_symbols", "exp_histogram"],
    "kernels.ctx_coder": ["_encode_gaps", "_encode_values", "_decode_gaps", "_decode_values", "_positions",
                          "_value_tables", "write_codes", "restore_codes"],
}


def test_hot_kernel_loops_make_no_refcount_calls(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))  # an empty cache: all compiles, IR kept
    dump = tmp_path / "ir.json"
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(HOT), str(dump)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    irs = json.loads(dump.read_text())
    assert set(irs) == {f"{m}.{n}" for m, names in HOT.items() for n in names}
    assert all(irs.values()), f"kernels that warm_up did not compile: {[k for k, v in irs.items() if not v]}"
    found = {k: [loop_refcounts(ir) for ir in v] for k, v in irs.items()}
    bad = {k: v for k, v in found.items() if any(v)}
    assert not bad, f"refcount calls inside the loops of {bad} (per element or change: see the module docstring)"
