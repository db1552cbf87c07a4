"""The torch.distributed transport (T2): the frame codec and prefix validation in one process,
then point-to-point and broadcast over a real gloo group of three processes (127.0.0.1, a free
port chosen at run time, every join bounded: a hang is a failure, never a stuck CI job).

Message types here are this module's own registered dataclasses: the transport knows no
protocol above it. Workers write their results as JSON; the test process only reads them.
Nothing asserts on elapsed time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist

from aiosync.errors import ConfigError, PayloadError, TransportError
from aiosync.messages import message, type_name
from aiosync.transports.distributed import (MAGIC, MAX_HEADER_BYTES, DistributedTransport, Frame, Prefix,
                                            WeightSyncGroup, decode_message, encode_message, register_message)
from aiosync.transports.distributed.group import _nccl_options
from aiosync.transports.distributed.wire import PREFIX_BYTES, encode_cached
from processes import JOIN_BOUND, join, results, start

ROGUE_TAG = 0x0BAD


@message
@dataclasses.dataclass(eq=False)
class Envelope:
    """A stand-in for a protocol message: a version and a list of payloads."""

    version: int
    payloads: list


@message
@dataclasses.dataclass
class Meta:
    """A stand-in for receiver metadata: names, shapes, dtype names, a mapping, flags."""

    keys: list
    shapes: list
    dtypes: list
    aliases: dict = dataclasses.field(default_factory=dict)
    flags: list = dataclasses.field(default_factory=list)
    session: int | None = None


def roundtrip(payload: Any) -> Any:
    frame = encode_message(payload)
    return decode_message(frame.header, frame.host, frame.device)


def same(a: Any, b: Any) -> bool:
    """Structural, bit-exact equality (tensors by dtype, shape and bits; NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                                b.reshape(-1).view(torch.uint8) if b.numel() else b))
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


# ------------------------------------------------------------------ the wire codec

def test_codec_round_trips_every_payload_shape_bit_exactly():
    payload = Envelope(7, [
        {"w": torch.randn(3, 5), "__aiosync__.version": torch.tensor(2**40, dtype=torch.int64),
         "h": torch.randn(4).to(torch.bfloat16), "mask": torch.tensor([True, False]),
         "empty": torch.zeros(0, 3), "z": torch.complex(torch.randn(2), torch.randn(2)),
         "nc": torch.arange(12.0).reshape(3, 4).t(), "nan": torch.tensor([float("nan"), -0.0])},
        Meta(["w", "b"], [(3, 5), ()], ["float32", "bfloat16"], {"b": "w"}, [True, False], session=5),
        b"\x00raw\xff", bytearray(b"x"),
        (1, 2.5, None, "s", float("nan"), float("-inf"), True, 2**70),
        {1: "int key", (2, 3): "tuple key"}, [torch.float16, [[]]],
    ])
    got = roundtrip(payload)
    assert isinstance(got, Envelope) and got.version == 7
    want = Envelope(payload.version, [*payload.payloads[:3], b"x", *payload.payloads[4:]])
    assert same(got, want)
    assert got.payloads[0]["nc"].is_contiguous()  # non-contiguous tensors arrive contiguous


def test_tensors_placed_out_of_band_travel_in_external_bodies():
    big, small = torch.randn(64, 8).to(torch.bfloat16), torch.arange(3)
    payload = {"big": big, "again": big, "small": small, "t": torch.randn(5).t()}
    seen: list = []

    def external(t: torch.Tensor):  # the caller's own tensors, by identity (a transport ships them itself)
        if t.numel() < 100:
            return None
        seen.append(t)
        return len(seen) - 1

    frame = encode_message(payload, external=external)
    assert seen[0] is big and frame.host.numel() < big.numel() * 2  # big left the packed body
    bodies = [t.contiguous().reshape(-1).view(torch.uint8).clone() for t in seen]
    got = decode_message(frame.header, frame.host, externals=bodies)
    assert same(got, payload)
    with pytest.raises(PayloadError, match="external body 1, which it does not carry"):
        decode_message(frame.header, frame.host, externals=bodies[:1])
    with pytest.raises(PayloadError, match="outside the body"):
        decode_message(frame.header, frame.host, externals=[bodies[0][:10], bodies[1]])


def test_dataclass_nodes_carry_the_module_qualname_and_dtypes_travel_by_name():
    frame = encode_message(Meta(["w"], [(2,)], ["bfloat16"], flags=[torch.bfloat16]))
    doc = json.loads(frame.header)
    assert doc["tree"]["$dc"] == type_name(Meta) == f"{Meta.__module__}:Meta"
    assert doc["tree"]["f"]["flags"] == [{"$dtype": "bfloat16"}]
    assert frame.host is None and frame.device is None and frame.nbytes == PREFIX_BYTES + len(frame.header)


def test_codec_refuses_what_it_cannot_rebuild_safely():
    @dataclasses.dataclass
    class Unregistered:
        x: int

    with pytest.raises(PayloadError, match="not a registered message type"):
        encode_message(Unregistered(1))
    with pytest.raises(PayloadError, match="cannot send a set"):
        encode_message({1, 2})
    # A header naming a class this side did not register is refused, never imported (no pickle).
    for name in ("os:system", "os.system", 7):
        header = json.dumps({"v": 1, "tensors": [], "tree": {"$dc": name, "f": {"command": "true"}}}).encode()
        with pytest.raises(PayloadError, match="not a registered message type"):
            decode_message(header)

    @register_message  # the old name: the same decorator as aiosync.messages.message
    @dataclasses.dataclass
    class Custom:
        x: torch.Tensor

    assert register_message is message
    assert torch.equal(roundtrip(Custom(torch.ones(2))).x, torch.ones(2))


def test_tensors_of_unsupported_kinds_are_refused():
    with pytest.raises(PayloadError, match="send it dense"):
        encode_message(torch.eye(3).to_sparse())


@pytest.mark.parametrize("tree, tensors, message", [
    ({"$t": 0}, [[0, 0, 400, "float32", [100]]], "outside the body"),
    ({"$t": 0}, [[0, 0, 8, "float32", [10]]], "do not hold"),
    ({"$t": 0}, [[0, 0, 4, "no_such_dtype", [1]]], "unknown dtype"),
    ({"$t": 0}, [[0, 0, 4, "Tensor", [1]]], "unknown dtype"),
    ({"$t": 0}, [[1, 0, 4, "float32", [1]]], "does not carry"),
    ({"$t": 3}, [], "does not describe"),
    ({"$what": 1}, [], "unknown node"),
    ({"$b": [0]}, [], "malformed message"),
    ({"$float": "not a float"}, [], "malformed message"),
    ({"$dc": type_name(Meta), "f": {"nope": 1}}, [], "cannot rebuild Meta"),
    ({"$dc": type_name(Meta), "f": [1]}, [], "malformed dataclass node"),
])
def test_malformed_headers_are_clear_payload_errors(tree, tensors, message):
    header = json.dumps({"v": 1, "tensors": tensors, "tree": tree}).encode()
    with pytest.raises(PayloadError, match=message):
        decode_message(header, torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(PayloadError, match="not valid JSON"):
        decode_message(b"\xff{")
    with pytest.raises(PayloadError, match="unknown layout"):
        decode_message(json.dumps({"v": 3, "tensors": [], "tree": None}).encode())


async def test_a_payload_object_sent_again_reuses_its_frame():
    env = Envelope(1, [torch.ones(3)])
    first = await encode_cached(env, None)
    assert await encode_cached(env, None) is first  # fan-out: encoded once
    big = {"t": torch.zeros(1 << 19)}  # 2 MiB: packed in a worker thread; a dict is never cached
    frame = await encode_cached(big, None)
    assert frame is not await encode_cached(big, None)
    assert same(decode_message(frame.header, frame.host, frame.device), big)


# ------------------------------------------------------------------ the prefix, validated in one place

def test_a_frame_announces_itself_with_its_prefix():
    frame = encode_message({"w": torch.zeros(10), "b": b"xy"})
    p = frame.prefix
    assert p == Prefix(len(frame.header), frame.host.numel(), 0)
    assert frame.nbytes == p.nbytes == PREFIX_BYTES + len(frame.header) + frame.host.numel()
    words = p.tensor()
    assert words.dtype == torch.int64 and words.tolist() == [MAGIC, p.header_bytes, p.host_bytes, 0]
    assert Prefix.parse(words, sender="rank 1") == p
    assert Prefix.parse(words.tolist(), sender="rank 1") == p
    assert Prefix.buffer().tolist() == [0, 0, 0, 0]
    assert bytes(frame.header_tensor().numpy()) == frame.header
    assert Frame(b"{}", None, None).nbytes == PREFIX_BYTES + 2


@pytest.mark.parametrize("words, kwargs, message", [
    ([0, 10, 0, 0], {}, r"rank 3 sent a frame that is not an aiosync message \(prefix \[0, 10, 0, 0\]\)"),
    ([MAGIC, 0, 0, 0], {}, "header would be 0 bytes"),
    ([MAGIC, MAX_HEADER_BYTES + 1, 0, 0], {}, f"header would be {MAX_HEADER_BYTES + 1} bytes, outside"),
    ([MAGIC, 10, -1, 0], {}, "negative body size"),
    ([MAGIC, 10, 0, -5], {}, "negative body size"),
    ([MAGIC, 10, 0, 64], {"device_body": False}, "64 bytes of device tensors, but this end has no device data group"),
    ([MAGIC, 10, 0], {}, "prefix of 3 words"),
])
def test_bad_prefixes_are_refused_before_anything_is_allocated(words, kwargs, message):
    with pytest.raises(PayloadError, match=message):
        Prefix.parse(torch.tensor(words, dtype=torch.int64), sender="rank 3", **kwargs)


def test_the_largest_header_allowed_is_accepted():
    assert Prefix.parse([MAGIC, MAX_HEADER_BYTES, 0, 64], sender="rank 0").header_bytes == MAX_HEADER_BYTES


# ------------------------------------------------------------------ groups without processes

_NO_GROUP_CHECK = """
from aiosync.errors import TransportError
from aiosync.transports.distributed import DistributedTransport
try:
    DistributedTransport(1)
except TransportError as exc:
    print("refused:", exc)
else:
    print("accepted")
"""


def test_a_transport_needs_an_initialised_process_group():
    # A fresh interpreter: an in-process vLLM engine elsewhere in the suite leaves this
    # process with a default process group, which would make the check vacuous here.
    out = subprocess.run([sys.executable, "-c", _NO_GROUP_CHECK], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.startswith("refused:") and "not initialised" in out, out


def test_backend_choice_errors_are_clear():
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        with pytest.raises(ConfigError, match="backend nccl needs CUDA"):
            WeightSyncGroup.init(backend="nccl")
    with pytest.raises(ValueError, match="auto, gloo or nccl"):
        WeightSyncGroup.init(backend="mpi")
    assert _nccl_options(None, {}) == (None, None)


class _FakeNcclOptions:
    """Stands in for ``ProcessGroupNCCL.Options`` on a torch build without NCCL."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"max_ctas": None, "min_ctas": None})()


def _fake_nccl_world(monkeypatch) -> list[dict]:
    """torch.distributed and CUDA as a GPU rank sees them, with ``new_group`` recording how each
    group is made (and what ``NCCL_ALGO`` holds at that moment)."""
    made: list[dict] = []

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, device_id=None, **kw):
        made.append({"backend": backend, "pg_options": pg_options, "device_id": device_id, "timeout": timeout,
                     "NCCL_ALGO": os.environ.get("NCCL_ALGO"), "warmed": False})
        return f"{backend}-group-{len(made)}"

    def barrier(group=None, device_ids=None, **kw):  # the warm-up at init (issue 18)
        made[int(group.rsplit("-", 1)[1]) - 1]["warmed"] = device_ids

    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: str(group).split("-")[0])
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("PG", (), {"Options": _FakeNcclOptions}), raising=False)
    return made


def test_comm_options_reach_the_nccl_communicator_and_no_environment_variable_is_left_set(monkeypatch):
    from aiosync.syncers.config import CommOptions

    made = _fake_nccl_world(monkeypatch)
    options = CommOptions(use_ring_sync=True, nccl_max_ctas=8, nccl_min_ctas=2)
    group = WeightSyncGroup.init(backend="nccl", comm_options=options)
    nccl = [g for g in made if g["backend"] == "nccl"]
    assert len(nccl) == 1 and nccl[0]["NCCL_ALGO"] == "Ring"  # set while the communicator was made...
    assert "NCCL_ALGO" not in os.environ  # ... and only then: no other communicator sees it
    assert nccl[0]["device_id"] is not None  # made eagerly, so NCCL reads the variable now
    assert nccl[0]["warmed"] == [0]  # and connected at init, collectively (never at a first send)
    assert nccl[0]["timeout"].total_seconds() == 1200  # bounded by 2 × timeout, not the control group's day
    assert [g["timeout"].days for g in made if g["backend"] == "gloo"] == [1]
    assert (nccl[0]["pg_options"].config.max_ctas, nccl[0]["pg_options"].config.min_ctas) == (8, 2)
    assert set(group.comm_report) == {"use_ring_sync", "nccl_max_ctas", "nccl_min_ctas"}
    t = group.transport(1)
    assert t.data_group == "nccl-group-2" and t.comm_options is options  # every op of the channel uses it
    assert set(t.use_comm_options(options)) == {"use_ring_sync", "nccl_max_ctas", "nccl_min_ctas"}
    with pytest.raises(ConfigError, match="WeightSyncGroup.init\\(comm_options="):
        t.use_comm_options(CommOptions(nccl_max_ctas=4))  # the syncer asks for other options
    plain = WeightSyncGroup.init(backend="nccl").transport(1)  # made without options
    assert plain.use_comm_options(CommOptions()) == {}
    with pytest.raises(ConfigError, match="was made with"):
        plain.use_comm_options(options)


def test_a_process_wide_nccl_algo_is_kept_and_reported(monkeypatch):
    from aiosync.syncers.config import CommOptions

    made = _fake_nccl_world(monkeypatch)
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    group = WeightSyncGroup.init(backend="nccl", comm_options=CommOptions(use_ring_sync=True))
    assert os.environ["NCCL_ALGO"] == "Tree" and made[-1]["NCCL_ALGO"] == "Tree"
    assert "not changed" in group.comm_report["use_ring_sync"]


def test_comm_options_have_no_effect_on_gloo_or_in_process_and_say_so(monkeypatch):
    from aiosync.syncers.config import CommOptions
    from aiosync.transports.inproc import inproc_pair

    _fake_nccl_world(monkeypatch)
    options = CommOptions(use_ring_sync=True)
    gloo = WeightSyncGroup.init(backend="gloo", comm_options=options).transport(1)
    assert gloo.use_comm_options(options) == {"use_ring_sync": "no effect on gloo (use_ring_sync=True)"}
    assert "no communicator" in inproc_pair()[0].use_comm_options(options)["use_ring_sync"]


async def test_the_synchronizer_hands_its_syncers_comm_options_to_each_channel():
    from aiosync.coordination import Synchronizer
    from aiosync.transports.inproc import inproc_pair
    from helpers import trainer_state

    seen = []

    class Recording(type(inproc_pair()[0])):
        def use_comm_options(self, options):
            seen.append(options)
            return super().use_comm_options(options)

    cfg = {"type": "patch", "use_ring_sync": True, "nccl_max_ctas": 2}
    async with Synchronizer({}, cfg) as sync:
        await sync.attach_trainer(trainer_state())
        a, _b = inproc_pair()
        a.__class__ = Recording
        sync.serve_remote(a)
    assert seen and seen[0].use_ring_sync and seen[0].nccl_max_ctas == 2


# ------------------------------------------------------------------ process plumbing

async def _wait_for_file(path: Path, bound: float = JOIN_BOUND) -> None:
    """Another process's signal: the file appears (polled; only the bound is a time)."""
    with anyio.fail_after(bound):
        while not path.exists():
            await anyio.sleep(0.02)


# ------------------------------------------------------------------ the scenario (run in the workers)

@dataclasses.dataclass
class _CommOptions:
    """What :meth:`WeightSyncGroup.init` reads of W4's options (``aiosync.syncers.config.CommOptions``);
    a stand-in, so that this test of the transport does not depend on the syncers."""

    use_ring_sync: bool = True
    nccl_max_ctas: int | None = 4
    nccl_min_ctas: int | None = None
    is_default: bool = False


def _ring_options() -> _CommOptions:
    return _CommOptions()


def _scenario_transport(rank: int, world: int, out: Path, extra: dict) -> dict:
    from aiosync.errors import PeerTimeoutError

    group = WeightSyncGroup.init(backend="gloo", timeout=2.0, comm_options=_ring_options())

    async def trainer() -> dict:
        t1, t2 = group.transport(1), group.transport(2)
        packet = Envelope(3, [{"w": torch.arange(6.0).reshape(2, 3), "m": torch.tensor([True, False])},
                              Meta(["w"], [(2, 3)], ["bfloat16"]), b"raw", (1, None, "s")])
        await t1.send(packet)
        await t2.send(packet)  # the same object again: its encoded frame is reused
        echo = await t1.recv()
        assert await t1.recv() == "go"  # sent by rank 1 while its receive below was pending
        from aiosync import reclaim

        released = reclaim.statistics.released_bytes
        await t1.send(torch.arange(2_000_000, dtype=torch.float32))  # its packed copy is let go off the loop
        released = reclaim.statistics.released_bytes - released
        got = await group.broadcast({"all": torch.full((3,), 7.0)}, src=0)
        # A rogue broadcast: a prefix announcing a header above the bound. Receivers refuse it
        # through the same validation as point-to-point, before allocating anything.
        dist.broadcast(torch.tensor([MAGIC, MAX_HEADER_BYTES + 1, 0, 0], dtype=torch.int64), src=0,
                       group=group.group)
        # A rogue point-to-point frame on a channel of its own (rank 1 refuses it and that channel breaks).
        dist.send(torch.tensor([0x0BAD, 10, 0, 0], dtype=torch.int64), 1, group=group.group, tag=ROGUE_TAG)
        timed_out = False
        try:
            await t2.recv()  # rank 2 sends only after our timeout
        except PeerTimeoutError:
            timed_out = True
        (out / "rank0-timed-out").write_text("")
        late = await t2.recv()  # the same posted receive, resumed: nothing lost
        (out / "rank0-got-late").write_text("")
        try:
            await t2.recv()  # rank 2 is gone now
            dead = "no error"
        except TransportError as exc:
            dead = type(exc).__name__
        await t1.send("still served")
        return {"echo": echo, "bcast": got["all"].tolist(), "timed_out": timed_out, "late": late, "dead": dead,
                "report": group.comm_report, "t1": dataclasses.asdict(t1.statistics()),
                "t2_timeouts": t2.statistics().timeouts, "released": released}

    async def explorer() -> dict:
        t = group.transport(0)
        p = await t.recv()
        ok = (isinstance(p, Envelope) and p.version == 3
              and torch.equal(p.payloads[0]["w"], torch.arange(6.0).reshape(2, 3))
              and p.payloads[0]["m"].tolist() == [True, False] and p.payloads[1].shapes == [(2, 3)]
              and p.payloads[2] == b"raw" and p.payloads[3] == (1, None, "s"))
        result: dict = {}
        if rank == 1:
            await t.send({"ok": ok})
            # The loop is never blocked by a pending receive: another task sends meanwhile.
            # (If recv blocked the loop, "go" would never leave and both ranks would time out.)
            big = {}

            async def receive() -> None:
                big["t"] = await t.recv()

            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                await anyio.sleep(0)
                await t.send("go")
            ok = ok and torch.equal(big["t"], torch.arange(2_000_000, dtype=torch.float32))
        got = await group.broadcast(src=0)
        try:
            await group.broadcast(src=0)
            result["rogue_bcast"] = "accepted"
        except PayloadError as exc:
            result["rogue_bcast"] = str(exc)
        if rank == 1:
            rogue = group.transport(0, tag=ROGUE_TAG)
            try:
                await rogue.recv()
                result["rogue_p2p"] = "accepted"
            except TransportError as exc:
                result["rogue_p2p"] = str(exc)
                result["rogue_broken"] = type(rogue.broken).__name__
            try:
                await rogue.recv()
            except TransportError as exc:
                result["rogue_again"] = str(exc)
        if rank == 2:
            await _wait_for_file(out / "rank0-timed-out")
            await t.send("late but whole")
            await _wait_for_file(out / "rank0-got-late")
            os._exit(0)  # die without closing anything, like a crash
        msg = None
        while msg is None:
            try:
                msg = await t.recv()
            except PeerTimeoutError:
                continue
        return {"ok": ok, "bcast": got["all"].tolist(), "last": msg, "stats": dataclasses.asdict(t.statistics()),
                **result}

    return anyio.run(trainer if rank == 0 else explorer)


SCENARIOS = {"transport": _scenario_transport}


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_transport_payloads_broadcast_timeouts_bad_frames_and_a_dead_peer(tmp_path):
    procs = start(__name__, "transport", 3, tmp_path)
    join(procs)
    r = results(tmp_path, [0, 1])
    assert r[1]["ok"] and r[0]["echo"] == {"ok": True}
    assert r[0]["bcast"] == r[1]["bcast"] == [7.0, 7.0, 7.0]
    # the oversized header of a broadcast is refused by the shared prefix validation
    assert f"header would be {MAX_HEADER_BYTES + 1} bytes" in r[1]["rogue_bcast"], r[1]["rogue_bcast"]
    assert "rank 0 (broadcast)" in r[1]["rogue_bcast"]
    # a point-to-point frame that is not an aiosync message breaks only its own channel
    assert "not an aiosync message" in r[1]["rogue_p2p"] and r[1]["rogue_broken"] == "PayloadError"
    assert "is broken" in r[1]["rogue_again"]
    assert r[0]["timed_out"] and r[0]["late"] == "late but whole"  # a timeout lost nothing
    assert r[0]["t2_timeouts"] == 1
    assert r[0]["dead"] == "TransportError"  # the dead peer is an error, not a hang...
    assert r[1]["last"] == "still served"  # ...and the other channel is unaffected
    assert all("no effect on gloo" in v for v in r[0]["report"].values()) and set(r[0]["report"]) == {
        "use_ring_sync", "nccl_max_ctas"}
    sent, received = r[0]["t1"], r[1]["stats"]
    assert (sent["messages_sent"], sent["messages_received"]) == (3, 2)
    assert (received["messages_received"], received["messages_sent"]) == (3, 2)
    assert sent["bytes_sent"] == received["bytes_received"] > 8_000_000  # framing included, counted alike
    assert r[0]["released"] >= 8_000_000  # the 8 MB message's packed copy, given back off the loop once sent
    assert sent["bytes_received"] == received["bytes_sent"] and sent["timeouts"] == 0 and sent["encode_s"] > 0
