"""Bootstrap-sized transfers between Ray actors: the object store vs a gloo collective group.

    python examples/ray_transfer_bench.py --mb 64 256 --json out.json

Three actors on one local Ray cluster: a sender (the trainer) and two receivers (explorers). For
each size, in one run, ``--repeats`` transfers of one float32 tensor, timed from the driver
(both sides' calls issued at once, until both returned); the fastest and the median are kept:

* ``object_store`` — ``ray.put`` once, the receiver fetches the object and copies it into a
  tensor of its own (what :class:`aiosync.transports.ray.RayChannel` does with large tensors);
  ``object_store_no_copy`` — the same without the receiver's copy (the cost of that copy);
* ``ray_channel`` — the whole aiosync path: ``RayChannel.send`` of a payload holding the tensor,
  ``recv`` on the receiver (encode, put, actor call, fetch, copy, decode);
* ``gloo`` — a ``ray.util.collective`` group (backend ``torch_gloo``) over the three actors,
  made once before timing: ``send`` / ``recv`` between the sender and one receiver;
* fan-out to both receivers: ``object_store_x2`` (one put, two fetches) and ``gloo_broadcast_x2``.

Prints (and writes) one JSON object: seconds (fastest, median) and GB/s (of the fastest) per
method and size. The group is made
outside the timings; making it is a collective of every member, and an actor belongs to one gloo
group at a time (Ray's rule), which is why aiosync's elastic explorers use the object store.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import anyio
import ray
import torch

from aiosync.transports.ray import RayChannel, RayEndpoint

GROUP = "aiosync-bench"


@ray.remote(num_cpus=0)
class Node(RayEndpoint):
    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.tensors: dict[int, torch.Tensor] = {}
        self.channels: dict[str, RayChannel] = {}

    def make(self, n: int) -> None:
        self.tensors[n] = torch.arange(n, dtype=torch.float32)

    # -- the object store --------------------------------------------------------------

    async def put_and_hand(self, n: int, receivers: list) -> None:
        ref = ray.put(self.tensors[n].numpy())  # one copy into the store, however many receivers
        for r in [r.take.remote([ref]) for r in receivers]:
            await r

    async def take(self, refs: list, copy: bool = True) -> int:
        array = await refs[0]  # a read-only view into the node's shared-memory store
        if copy:
            array = array.copy()  # the receiver's own bytes, as RayChannel.recv does
        return int(array.size)

    async def put_and_hand_no_copy(self, n: int, receivers: list) -> None:
        ref = ray.put(self.tensors[n].numpy())
        for r in [r.take.remote([ref], False) for r in receivers]:
            await r

    # -- the aiosync channel -------------------------------------------------------------

    async def open(self, peer, channel: str | None = None) -> str:
        ch = RayChannel(peer, channel) if channel else RayChannel(peer)
        self.channels[ch.channel] = ch
        return ch.channel

    async def channel_send(self, channel: str, n: int) -> None:
        await self.channels[channel].send({"w": self.tensors[n]})

    async def channel_recv(self, channel: str) -> int:
        return int((await self.channels[channel].recv())["w"].numel())

    # -- a gloo collective group ----------------------------------------------------------

    def gloo_send(self, n: int, dst: int) -> None:
        import ray.util.collective as col

        col.send(self.tensors[n], dst, GROUP)

    def gloo_recv(self, n: int, src: int) -> int:
        import ray.util.collective as col

        buf = torch.empty(n, dtype=torch.float32)
        col.recv(buf, src, GROUP)
        return int(buf.numel())

    def gloo_broadcast(self, n: int) -> int:
        import ray.util.collective as col

        buf = self.tensors.get(n)
        if buf is None:
            buf = torch.empty(n, dtype=torch.float32)
        col.broadcast(buf, 0, GROUP)
        return int(buf.numel())


async def timed(refs_fn, repeats: int, setup=None) -> tuple[float, float]:
    """(fastest, median) seconds of ``repeats`` runs: on a shared machine the fastest is the
    closest to the uncontended cost, the median shows the spread."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            ray.get(setup())
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(ray.get, refs_fn())
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


async def bench(args: argparse.Namespace) -> dict:
    from ray.experimental.collective import create_collective_group

    sender, r1, r2 = Node.remote(), Node.remote(), Node.remote()
    ray.get([a.__ray_ready__.remote() for a in (sender, r1, r2)])
    channel = ray.get(sender.open.remote(r1))
    ray.get(r1.open.remote(sender, channel))
    create_collective_group([sender, r1, r2], backend="torch_gloo", name=GROUP)
    out: dict = {"repeats": args.repeats, "rows": {}}
    for mb in args.mb:
        n = mb * (1 << 20) // 4
        ray.get(sender.make.remote(n))
        ray.get([sender.gloo_send.remote(n, 1), r1.gloo_recv.remote(n, 0)])  # warm-up of the group
        ray.get([sender.channel_send.remote(channel, n), r1.channel_recv.remote(channel)])  # warm-up
        rows = {
            "object_store": await timed(lambda: sender.put_and_hand.remote(n, [r1]), args.repeats),
            "object_store_no_copy": await timed(lambda: sender.put_and_hand_no_copy.remote(n, [r1]), args.repeats),
            "ray_channel": await timed(lambda: [sender.channel_send.remote(channel, n), r1.channel_recv.remote(channel)],
                                       args.repeats, setup=lambda: sender.make.remote(n)),  # a new tensor: a new put
            "gloo": await timed(lambda: [sender.gloo_send.remote(n, 1), r1.gloo_recv.remote(n, 0)], args.repeats),
            "object_store_x2": await timed(lambda: sender.put_and_hand.remote(n, [r1, r2]), args.repeats),
            "gloo_broadcast_x2": await timed(lambda: [a.gloo_broadcast.remote(n) for a in (sender, r1, r2)],
                                             args.repeats),
        }
        out["rows"][f"{mb}MB"] = {k: {"fastest_s": round(lo, 4), "median_s": round(mid, 4),
                                      "GB/s": round(mb / 1024 / lo, 2)} for k, (lo, mid) in rows.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, nargs="+", default=[64, 256], help="transfer sizes in MiB")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        result = anyio.run(bench, args)
    finally:
        ray.shutdown()
    print(json.dumps(result, indent=2), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
