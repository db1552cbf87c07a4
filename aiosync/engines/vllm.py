"""A vLLM engine as an explorer model: :class:`VLLMTarget`.

The engine is attached like any other explorer model — the same ``Explorer``, the same
``attach_explorer`` or remote-explorer API, patch or bucket sync, every method and style::

    llm = LLM(model=path, dtype="float32", weight_transfer_config={"backend": "aiosync"})
    target = VLLMTarget(llm)                                  # or an AsyncLLM
    explorer = await sync.attach_explorer("vllm", target)
    outputs = await target.generate(prompts, SamplingParams(n=8, max_tokens=16))
    versions = output_versions(outputs[0].outputs[0])         # e.g. (4,) or (4, 5)

What the syncers write is a host copy of the weights in checkpoint names (the target is a
``Mapping[str, Tensor]``: the *shadow*), loaded from the engine's checkpoint and kept in the
engine's dtype. A patch is decoded against it (a patch needs the receiver's old values, and a
CPU engine re-packs its linear weights into a form that cannot be read back). The target is
a :class:`~aiosync.syncers.base.CommitTarget`: when a write has changed the shadow,
:meth:`VLLMTarget.commit_write` sends the changed layers, whole, through vLLM's own
weight-update path to the ``aiosync`` backend in the engine's workers
(:mod:`aiosync.engines.vllm_backend`), where the model's own weight loader maps them to its
layout (fused q/k/v and gate/up, tensor-parallel shards).

**Each write is one transaction** (:meth:`VLLMTarget._send`): pause, open the update, send the
buckets (the engine validates and stages them), commit (the engine loads them all or nothing),
close, label, resume. Whatever fails — a refused bucket, a load that raises, a bucket that never
comes or comes too late, a timeout — the engine has kept its previous weights and label by the
time generation resumes, requests in flight go on on them, and the next write is accepted.

Generation is paused only for the write: ``pause_mode="keep"`` (the default) freezes the
requests in flight and resumes them on the new weights, ``"wait"`` lets them finish first,
``"abort"`` (``AsyncLLM`` only) aborts them. The engine labels its weights with the aiosync
version, and vLLM stamps every output with the versions that generated its tokens
(``CompletionOutput.weight_versions``); :func:`output_versions` reads them as aiosync versions.

Generation of an offline ``LLM`` goes through :meth:`VLLMTarget.generate`, which steps the
engine in a thread of its own (the ``LLM`` is not thread-safe) so that writes land between two
steps. An ``AsyncLLM`` may also be used directly; its writes pause it through
``pause_generation`` / ``resume_generation``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

from ..dtypes import dtype_name
from ..errors import ApplyError, ConfigError, PeerTimeoutError, VersionError
from ..syncers.bucket.format import bucket_manifest, iter_named_tensor_buckets, seal_bucket
from .layout import checkpoint_layout, incomplete_group, layout_problem, spec_of, tied_aliases
from .vllm_calls import AsyncCalls, Late, OfflineCalls, ResumeFailed
from .vllm_plugin import BACKEND, BACKENDS

log = logging.getLogger("aiosync.engines")
PAUSE_MODES = ("keep", "wait", "abort")
#: In an engine's error: it no longer knows its weights (see :mod:`aiosync.engines.vllm_backend`).
_UNKNOWN = "the engine's weights are unknown"


@dataclass
class EngineStats:
    """Counters of a :class:`VLLMTarget` (mutable; :meth:`VLLMTarget.statistics` snapshots them)."""

    commits: int = 0
    #: Commits that sent weights to the engine (an empty patch only relabels the version).
    writes: int = 0
    #: Calls to put the old values back after a failed write (``commit_write(keys, None)``).
    restores: int = 0
    #: Writes the engine refused or that were aborted; it kept its previous weights each time.
    refused: int = 0
    tensors_sent: int = 0
    bytes_sent: int = 0
    #: How long generation was paused for a write: the last, the longest, in total.
    last_pause_s: float = 0.0
    max_pause_s: float = 0.0
    total_pause_s: float = 0.0
    requests: int = 0


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of a :class:`VLLMTarget`'s counters (see :class:`EngineStats`) and state."""

    version: int | None
    pause_mode: str
    broken: bool
    commits: int
    writes: int
    restores: int
    refused: int
    tensors_sent: int
    bytes_sent: int
    last_pause_s: float
    max_pause_s: float
    total_pause_s: float
    requests: int
    #: How writes reach the engine: ``"inplace"`` (patches written in its parameters) or ``"shadow"``.
    path: str = "shadow"

    @property
    def mean_pause_s(self) -> float:
        return self.total_pause_s / self.writes if self.writes else 0.0


def output_versions(output: Any) -> tuple[int, ...]:
    """The aiosync versions whose weights generated ``output``, oldest first.

    ``output`` is a vLLM ``CompletionOutput`` (one sample) or ``RequestOutput`` (all its
    samples). A request in flight across a write (``pause_mode="keep"``) has two or more.
    Raises :class:`~aiosync.errors.VersionError` for tokens the engine generated before
    aiosync wrote it (vLLM labels them ``"default"``) or without labels.
    """
    completions = getattr(output, "outputs", None)
    if completions is not None:
        return tuple(sorted({v for c in completions for v in output_versions(c)}))
    spans = getattr(output, "weight_versions", None)
    if spans is None:
        raise VersionError("this output carries no weight versions (not finished, or no tokens were generated)")
    out: list[int] = []
    for span in spans:
        try:
            v = int(span.version)
        except ValueError:
            raise VersionError(f"tokens {span.start}..{span.end} were generated by weights labelled "
                               f"{span.version!r}, not by a version aiosync wrote") from None
        if not out or out[-1] != v:
            out.append(v)
    return tuple(out)


class _Kept(Exception):
    """A write failed and the engine provably holds what it held before; ``error`` is for the user."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _engine_kind(engine: Any) -> str:
    from vllm import LLM
    from vllm.v1.engine.async_llm import AsyncLLM

    if isinstance(engine, LLM):
        return "llm"
    if isinstance(engine, AsyncLLM):
        return "async"
    raise TypeError(f"VLLMTarget needs a vllm.LLM or a vllm AsyncLLM, got {type(engine).__name__}")


def check_target_args(engine: Any, kind: str, pause_mode: str, bucket_size: int, timeout: float) -> Any:
    """The engine's ``vllm_config``, once the engine and the target's arguments are checked."""
    vllm_config = engine.llm_engine.vllm_config if kind == "llm" else engine.vllm_config
    wt = vllm_config.weight_transfer_config
    if wt is None or wt.backend not in BACKENDS:
        raise ConfigError(f"VLLMTarget: start the engine with weight_transfer_config={{'backend': '{BACKEND}'}} "
                          f"(it has {None if wt is None else wt.backend!r}); aiosync registers that backend with "
                          "vLLM as a plugin when it is installed")
    if pause_mode not in PAUSE_MODES:
        raise ConfigError(f"VLLMTarget: pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    if pause_mode == "abort" and kind == "llm":
        raise ConfigError("VLLMTarget: pause_mode='abort' needs an AsyncLLM (vLLM aborts in-flight requests "
                          "there); with an offline LLM use 'keep' or 'wait'")
    if bucket_size <= 0 or timeout <= 0:
        raise ConfigError("VLLMTarget: bucket_size and timeout must be positive")
    return vllm_config


def _choose_inplace(engine: Any, inplace: bool | None) -> bool:
    """Whether ``VLLMTarget(engine, inplace=...)`` writes in place: ``None`` (auto) when the
    engine is an in-process ``LLM`` whose parameters are all readable (none re-packed)."""
    if inplace is False:
        return False
    kind = _engine_kind(engine)
    if kind != "llm":
        if inplace:
            raise ConfigError("VLLMTarget: inplace=True needs an offline vllm.LLM in this process (an AsyncLLM's "
                              "workers run in another process; in-place writes there are not implemented yet)")
        return False
    from .vllm_inplace import engine_parameters_readable

    readable = engine_parameters_readable(engine)
    if inplace and not readable:
        raise ConfigError("VLLMTarget: inplace=True, but the engine re-packs its parameters (vLLM-CPU's oneDNN "
                          "linear layers), which cannot be written in place; use the default (inplace=None)")
    return readable


def load_checkpoint(path: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The ``*.safetensors`` tensors of a local model directory, floating ones cast to ``dtype``."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"VLLMTarget: {path} holds no *.safetensors files to start the host copy of the weights "
                          "from; pass tensors= (the weights the engine was started with, in checkpoint names)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                t = fh.get_tensor(key)
                out[key] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    return out


class VLLMTarget(Mapping[str, torch.Tensor]):
    """A vLLM engine (offline ``LLM`` or ``AsyncLLM``) as an explorer's model.

    The engine must be started with ``weight_transfer_config={"backend": "aiosync"}`` (vLLM
    finds the backend through aiosync's plugin entry point). ``tensors``: the weights the
    engine was started with, in checkpoint names (default: read from the engine's local model
    directory; reading it is heavy for a large model: build the target off the event loop,
    e.g. ``await aiosync.run_sync(VLLMTarget, llm)``). They are checked against the engine's
    checkpoint layout here (names, shapes, dtypes: a mismatch is a :class:`ConfigError`
    naming the tensor), kept in the engine's dtype, and must be the trainer's synced names.
    An engine that ties its output embedding to its input embedding (``tie_word_embeddings``)
    is detected: the target then also holds ``lm_head.weight`` (a copy of the input embedding,
    as a HF trainer's state dict has it), checks that the trainer keeps the two equal, and
    never sends it (``param_names`` without it works too). ``pause_mode``: what happens to
    requests in flight while a write lands (see the module docstring). ``clear_cache``: reset
    the prefix cache with each write (vLLM's default: cached prefixes were computed by the old
    weights). ``bucket_size``: bytes per ``update_weights`` call. ``timeout``: bound on every
    engine call and on a ``"wait"`` drain; a write whose call outlives it is aborted (the
    engine keeps its previous weights); only an engine that does not even answer the abort,
    or a commit that outlives twice the bound, leaves the target broken.

    ``inplace``: ``None`` (default) chooses the path — an in-process ``LLM`` whose parameters
    can be written as they are (a GPU; a CPU build without oneDNN re-packing) gets a
    :class:`~aiosync.engines.vllm_inplace.VLLMInPlaceTarget` (patches decoded and written in
    the engine's own parameters, no host copy), any other engine this class (the shadow);
    ``True`` insists on the first (a :class:`ConfigError` where it cannot be), ``False`` on the
    second. ``statistics().path`` says which.
    """

    path = "shadow"

    def __new__(cls, engine: Any, *, inplace: bool | None = None, **kwargs: Any) -> Any:
        if cls is VLLMTarget and _choose_inplace(engine, inplace):
            from .vllm_inplace import VLLMInPlaceTarget

            return VLLMInPlaceTarget(engine, **kwargs)
        return super().__new__(cls)

    def __init__(self, engine: Any, *, tensors: Mapping[str, torch.Tensor] | None = None, pause_mode: str = "keep",
                 clear_cache: bool = True, bucket_size: int = 256 << 20, timeout: float = 300.0,
                 inplace: bool | None = None) -> None:
        self.engine = engine
        self.kind = _engine_kind(engine)
        vllm_config = check_target_args(engine, self.kind, pause_mode, bucket_size, timeout)
        model_config = vllm_config.model_config
        self.dtype: torch.dtype = model_config.dtype
        if tensors is None:
            tensors = load_checkpoint(model_config.model, self.dtype)
        shadow = {k: (v.detach().to("cpu", self.dtype) if v.is_floating_point() else v.detach().cpu())
                  .contiguous().clone() for k, v in tensors.items()}
        text_config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
        self._aliases = tied_aliases(shadow, bool(getattr(text_config, "tie_word_embeddings", False)))
        for alias, source in self._aliases.items():
            if alias not in shadow:
                shadow[alias] = shadow[source].clone()
            elif not torch.equal(shadow[alias], shadow[source]):
                raise ConfigError(f"VLLMTarget: tensors[{alias!r}] differs from tensors[{source!r}], but the engine "
                                  "ties them (tie_word_embeddings): give the weights the engine was started with")
        self._shadow = shadow
        self._engine_keys = [k for k in shadow if k not in self._aliases]
        self._check_layout(model_config.model)
        groups = _groups_of(self._engine_keys)  # vLLM's own partition: one group per decoder layer
        self._group_of = {k: i for i, g in enumerate(groups) for k in g}
        self._groups = groups
        self.pause_mode, self.clear_cache = pause_mode, clear_cache
        self.bucket_size = bucket_size
        #: The version the engine holds (as labelled), ``None`` before the first write.
        self.version: int | None = None
        #: Why the target gave up (the engine's weights are unknown), or ``None``.
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self._dirty: set[str] = set(self._engine_keys)  # engine keys it may not hold as the shadow does: all, at first
        self._undone: set[str] = set()  # keys of a refused write: equal again once the shadow is rolled back
        self._synced_aliases: set[str] = set()
        self._initialized = False
        self._nonce, self._update_ids = uuid.uuid4().hex[:12], itertools.count()  # update ids unique per engine
        calls = OfflineCalls if self.kind == "llm" else AsyncCalls
        self._calls = calls(engine, pause_mode, clear_cache, timeout)

    @property
    def timeout(self) -> float:
        """The bound on every engine call (seconds); may be changed between writes."""
        return self._calls.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        if not seconds > 0:
            raise ConfigError(f"VLLMTarget: timeout must be positive, got {seconds!r}")
        self._calls.timeout = seconds

    def _check_layout(self, model_dir: str) -> None:
        layout = checkpoint_layout(model_dir)
        if layout is None:
            return  # no local checkpoint to compare with: the engine checks what it loads
        given = {k: spec_of(self._shadow[k]) for k in self._engine_keys}
        problem = layout_problem(layout, given, next(iter(self._aliases.values()), None))
        if problem is None and (gap := incomplete_group(_groups_of(list(layout)), given)):
            problem = (f"it holds {gap[1]!r} but not {gap[0]!r} of the same layer (the engine rebuilds a layer only "
                       "from all of its checkpoint tensors)")
        if problem is not None:
            raise ConfigError(f"VLLMTarget: tensors= does not match the checkpoint the engine was started from "
                              f"({model_dir}): {problem}. Give the weights the engine was started with, in its "
                              "checkpoint names")

    # -- the mapping the syncers read and write ------------------------------------------

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._shadow[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._shadow)

    def __len__(self) -> int:
        return len(self._shadow)

    # an engine handle: equal only to itself (Mapping would compare every tensor), hashable
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return (f"VLLMTarget({type(self.engine).__name__}, {len(self)} tensors, version={self.version}, "
                f"pause_mode={self.pause_mode!r})")

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the counters and the state."""
        return EngineStatistics(self.version, self.pause_mode, self.error is not None,
                                **dataclasses.asdict(self.stats), path=self.path)

    def close(self) -> None:
        """Stop the engine thread of an offline ``LLM`` (the engine itself stays the caller's)."""
        self._calls.close()

    # -- writes (CommitTarget) -------------------------------------------------------------

    async def commit_write(self, keys: Sequence[str], version: int | None) -> None:
        """Make the engine hold the shadow's tensors ``keys`` (whole layers) and label them
        ``version``; ``None``: the syncer has put the shadow's old values back after a failed
        write, make the engine hold them (usually nothing to do: a failed write leaves the
        engine on its previous weights). Called by the syncers inside a staged write."""
        if self.error is not None:
            raise ApplyError(f"the vLLM engine target gave up after an earlier failure ({self.error}); the engine's "
                             "weights are unknown: make a new VLLMTarget (its first write sends every layer)")
        unknown = [k for k in keys if k not in self._shadow]
        if unknown:
            raise ApplyError(f"VLLMTarget: asked to commit keys it does not hold: {unknown[:3]}")
        self.stats.commits += 1
        written = set(keys)
        restoring = version is None
        if restoring:
            self.stats.restores += 1
            self._dirty -= self._undone  # the engine kept these; the shadow holds them again
            self._undone = set()
        engine_written = {self._aliases.get(k, k) for k in written}
        send = self._layers_of(self._dirty if restoring else engine_written | self._dirty)
        label = self.version if restoring else version
        before = set(self._dirty)
        try:
            self._follow_ties(written)
            if send:
                await self._send(send, label)
            elif label is not None and not restoring:
                await self._relabel(label)
        except _Kept as kept:
            self.stats.refused += 1
            if not restoring:
                self._undone = engine_written - before
                self._dirty |= engine_written
            raise kept.error from kept.error.__cause__
        except BaseException as exc:
            self._dirty |= set(send)
            if restoring and self.error is None:  # putting the old weights back failed: nobody knows what it holds
                self.error = exc
            raise
        self._dirty.clear()
        self._undone = set()
        self.version = label

    def _follow_ties(self, written: set[str]) -> None:
        """Tied embeddings: the engine holds one tensor for both names. A trainer that syncs the
        output embedding must keep it equal to the input embedding; one that does not (its
        ``param_names`` leave it out) gets it copied from the input embedding."""
        for alias, source in self._aliases.items():
            if alias in written:
                self._synced_aliases.add(alias)
            if alias in self._synced_aliases:
                if (alias in written or source in written) and not torch.equal(self._shadow[alias],
                                                                                self._shadow[source]):
                    raise _Kept(ApplyError(f"the trainer's {alias!r} differs from its {source!r}, but the vLLM "
                                           "engine ties them (tie_word_embeddings) and can hold only one: tie them "
                                           "in the trainer, or start the engine from an untied checkpoint. Nothing "
                                           "was written"))
            elif source in written:
                self._shadow[alias].copy_(self._shadow[source])

    def _layers_of(self, keys: set[str]) -> list[str]:
        """Every key of each vLLM layer group that holds one of ``keys``, in group order: a layer
        is rebuilt only from all of its checkpoint tensors (q, k and v of one ``qkv_proj``)."""
        wanted = {self._group_of[k] for k in keys}
        return [k for i in sorted(wanted) for k in self._groups[i]]

    def _init_info(self) -> dict:
        return {"manifest": [[k, list(self._shadow[k].shape), dtype_name(self._shadow[k].dtype)]
                             for k in self._engine_keys]}

    def _buckets(self, keys: list[str], label: int | None) -> list[dict[str, torch.Tensor]]:
        """The aiosync buckets (version-stamped, the first with the manifest) that carry ``keys``."""
        pairs = [(k, self._shadow[k]) for k in keys]
        groups = list(iter_named_tensor_buckets(pairs, self.bucket_size))
        manifest = bucket_manifest(groups)
        version = 0 if label is None else label  # 0: a bootstrap written without a version
        return [seal_bucket(dict(g), index=i, count=len(groups), version=version,
                            manifest=manifest if i == 0 else None) for i, g in enumerate(groups)]

    def _count_sent(self, keys: list[str], pause_s: float) -> None:
        s = self.stats
        s.writes += 1
        s.tensors_sent += len(keys)
        s.bytes_sent += sum(self._shadow[k].numel() * self._shadow[k].element_size() for k in keys)
        s.last_pause_s = pause_s
        s.max_pause_s = max(s.max_pause_s, pause_s)
        s.total_pause_s += pause_s

    # -- the update transaction --------------------------------------------------------------

    def _broken(self, why: str) -> ApplyError:
        self.error = ApplyError(f"{why}; {_UNKNOWN}: make a new VLLMTarget (its first write sends every layer)")
        return self.error

    def _refused(self, what: str, exc: BaseException) -> BaseException:
        """An engine call that answered with an error: the engine refused and kept its weights
        (:class:`_Kept`), unless it says it no longer knows them or it died."""
        if _UNKNOWN in str(exc) or self._calls.dead():
            return self._broken(f"the vLLM engine failed {what}: {exc}")
        return _Kept(ApplyError(f"the vLLM engine refused {what}: {exc}; the next sync sends it again"))

    async def _relabel(self, label: int) -> None:
        try:
            await self._calls.answer("the relabelling", self._calls.relabel(str(label)))
        except Late as late:
            late.drop()
            raise _Kept(PeerTimeoutError(f"{late}; the engine keeps version {self.version}")) from None
        except Exception as exc:
            raise self._refused(f"the relabelling to version {label}", exc) from exc

    async def _send(self, keys: list[str], label: int | None) -> None:
        """One transaction: the engine ends up holding ``keys`` labelled ``label``, or — raising
        :class:`_Kept` — exactly what it held before, and generation resumes only then. Shielded:
        every step is bounded, and a half-done transaction is never left behind."""
        calls = self._calls
        with anyio.CancelScope(shield=True):
            payloads = await calls.payloads(self._buckets(keys, label))  # before the pause
            t0 = time.perf_counter()
            try:
                async with calls.paused():
                    await self._init()
                    await self._transaction(payloads, label)
            except ResumeFailed as exc:
                raise self._broken(f"{exc}: generation may stay paused") from exc
            except _Kept:
                raise
            except ApplyError as exc:
                raise (self._broken(str(exc)) if calls.dead() else exc) from exc
            except Late as late:  # the pause did not answer
                late.drop()
                raise _Kept(PeerTimeoutError(f"{late}; nothing was written")) from None
            except TimeoutError as exc:  # a "wait" drain: the requests in flight did not finish
                raise _Kept(PeerTimeoutError(f"requests in flight did not finish within {self.timeout}s for the "
                                             "write (pause_mode='wait'); nothing was written")) from exc
            self._count_sent(keys, time.perf_counter() - t0)

    async def _init(self) -> None:
        """The engine's first call from this target: the manifest (checked there against the
        engine's own checkpoint before it replaces the previous one)."""
        if self._initialized:
            return
        calls = self._calls
        try:
            await calls.answer("init_weight_transfer_engine", calls.init(self._init_info()))
        except Late as late:
            late.drop()
            raise _Kept(PeerTimeoutError(f"{late}; nothing was written")) from None
        except Exception as exc:
            raise self._refused("the manifest of this target", exc) from exc
        self._initialized = True

    async def _transaction(self, payloads: list[dict], label: int | None) -> None:
        calls = self._calls
        update_id = f"{self._nonce}.{next(self._update_ids)}"
        what = f"the update to version {label}"
        try:
            await self._start()
            for i, payload in enumerate(payloads):
                await calls.answer(f"update_weights (bucket {i} of {len(payloads)} of {what})",
                                   calls.update({**payload, "update_id": update_id}))
        except Late as late:
            await self._abort_behind(late)
            raise _Kept(PeerTimeoutError(f"{late}; {what} was aborted, nothing was written: the engine keeps "
                                         f"version {self.version}. Raise VLLMTarget(timeout=...) if the engine is "
                                         "this slow")) from None
        except Exception as exc:
            raise self._refused(what, exc) from exc
        try:
            await calls.answer(f"the commit of {what}", calls.update({"update_id": update_id, "commit": True}),
                               patience=2)
        except Late as late:
            late.drop()
            raise self._broken(f"{late}: it may have committed or not") from None
        except Exception as exc:
            raise self._refused(what, exc) from exc
        try:
            await calls.answer("finish_weight_update", calls.finish(None if label is None else str(label), True))
        except (Late, Exception) as exc:
            if isinstance(exc, Late):
                exc.drop()
            raise self._broken(f"{what} was committed, but closing it failed: {exc}") from exc

    async def _start(self) -> None:
        calls = self._calls
        try:
            await calls.answer("start_weight_update", calls.start())
        except Late:
            raise
        except Exception as exc:
            if "already active" not in str(exc):
                raise
            # an update left open (a client that died, a finish that failed): close it, it was never committed
            log.warning("aiosync: closing an update the vLLM engine had left open")
            await calls.answer("finish_weight_update", calls.finish(None, False))
            await calls.answer("start_weight_update", calls.start())

    async def _abort_behind(self, late: Late) -> None:
        """The engine has not answered ``late`` yet: close the update behind it (the engine
        answers in order; an update that is not committed is discarded)."""
        try:
            await self._calls.answer("finish_weight_update (the abort)", self._calls.finish(None, False))
        except Late as again:
            again.drop()
            raise self._broken(f"{late}, and {again}") from None
        except Exception:  # the late call failed: the engine closed the update itself
            pass
        finally:
            late.drop()  # answered by now, or given up on

    # -- generation ----------------------------------------------------------------------

    async def generate(self, prompts: Sequence[Any], sampling_params: Any = None) -> list[Any]:
        """Generate for ``prompts`` (anything vLLM takes: token-id prompts, strings); returns the
        final ``RequestOutput`` of each, in order. Each completion's ``weight_versions`` names
        the versions that generated its tokens (:func:`output_versions`). Writes may land
        between two engine steps (``pause_mode``); under ``explorer.lease()`` none does."""
        if self.error is not None:
            raise ApplyError(f"the vLLM engine target gave up after an earlier failure: {self.error}")
        prompts = list(prompts)
        self.stats.requests += len(prompts)
        return await self._calls.generate(prompts, sampling_params)

    # -- read-back -----------------------------------------------------------------------

    async def read_engine(self) -> dict[str, torch.Tensor]:
        """Copies of the engine's own parameters that exist in checkpoint form (same name and
        shape as a key of this target: embeddings, norms, an untied ``lm_head``), read from
        the engine, for checking bit-exactness. Re-packed or fused weights (CPU linear layers,
        ``qkv_proj``) cannot be read back: check those by the engine's outputs. Offline
        ``LLM`` only (an ``AsyncLLM``'s workers run in another process)."""
        if self.kind != "llm":
            raise NotImplementedError("read_engine needs an in-process engine (vllm.LLM); an AsyncLLM's workers "
                                      "run in another process: compare its outputs instead")
        from .vllm_backend import read_parameters

        layout = {k: tuple(self._shadow[k].shape) for k in self._engine_keys}
        async with self._calls.lock:
            per_worker = await self._calls.call(self.engine.collective_rpc, read_parameters, args=(layout,))
        return per_worker[0]


def _groups_of(names: list[str]) -> list[list[str]]:
    """vLLM's partition of checkpoint names into layer groups (one per decoder layer)."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    return layerwise_groups(names)
