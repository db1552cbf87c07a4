"""An engine's checkpoint layout, and what is checked against it before anything is written.

Both sides of the vLLM adapter check what they are given against the names, shapes and dtypes
of the checkpoint the engine was started from (read from the ``*.safetensors`` headers of its
model directory, no tensor data): :class:`~aiosync.engines.vllm.VLLMTarget` its ``tensors=``
when it is built, and the ``aiosync`` backend each manifest an ``init_weight_transfer_engine``
brings. :func:`layout_problem` says what does not match — naming the tensor and both shapes
and dtypes, and how to fix the common cases (a name prefix such as ``module.``, a tied output
embedding) — and :func:`incomplete_group` what would leave a layer half loaded.

Tied embeddings: an engine started with ``tie_word_embeddings`` computes its output layer with
its input embedding; its checkpoint usually has no ``lm_head.weight``, while a HF trainer's
state dict has both. :func:`tied_aliases` names the pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..dtypes import dtype_name

#: safetensors' dtype codes (its header format) as torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: Name prefixes that wrappers add to a model's state-dict names (DDP, torch.compile, PEFT).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.", "model.")
#: The output embedding a tie replaces, and the input embeddings it is tied to (by name suffix).
TIED_OUTPUT = "lm_head.weight"
_INPUT_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of one checkpoint tensor (``dtype`` ``None``: not known to torch)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None

    def __str__(self) -> str:
        return f"{list(self.shape)} {dtype_name(self.dtype) if self.dtype is not None else '?'}"


def checkpoint_layout(path: str | Path) -> dict[str, TensorSpec] | None:
    """Names, shapes and dtypes of the tensors in the ``*.safetensors`` files of a local model
    directory (headers only); ``None`` where there are none (a hub id, ``.bin`` files)."""
    from safetensors import safe_open

    try:
        files = sorted(Path(path).glob("*.safetensors"))
    except (OSError, ValueError):
        return None
    if not files:
        return None
    out: dict[str, TensorSpec] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                s = fh.get_slice(key)
                out[key] = TensorSpec(tuple(s.get_shape()), _SAFETENSORS_DTYPES.get(s.get_dtype()))
    return out


def tied_aliases(names: Iterable[str], tied: bool) -> dict[str, str]:
    """``{output embedding: input embedding}`` when the engine ties them: e.g.
    ``{"lm_head.weight": "model.embed_tokens.weight"}``; empty without a tie or without exactly
    one input embedding among ``names``."""
    if not tied:
        return {}
    sources = [n for n in names if n.endswith(_INPUT_EMBEDDINGS) and n != TIED_OUTPUT]
    return {TIED_OUTPUT: sources[0]} if len(sources) == 1 else {}


def _prefix_hint(unknown: list[str], layout: Mapping[str, TensorSpec]) -> str:
    for p in _WRAPPER_PREFIXES:
        if all(n.startswith(p) and n[len(p):] in layout for n in unknown):
            return f"; without the prefix {p!r} they match: drop it from the names"
        if all(p + n in layout for n in unknown):
            return f"; with the prefix {p!r} they match: the engine's checkpoint names start with it"
    return ""


def layout_problem(layout: Mapping[str, TensorSpec], given: Mapping[str, TensorSpec],
                   tied_to: str | None = None) -> str | None:
    """What in ``given`` (name → shape and dtype) does not match the engine's checkpoint
    ``layout``, or ``None``. Floating tensors may differ in floating dtype (they are cast on
    loading); integer and bool ones must match. ``tied_to``: the input embedding the engine's
    output embedding is tied to, if it is."""
    unknown = [n for n in given if n not in layout]
    if unknown:
        if unknown == [TIED_OUTPUT] and tied_to is not None:
            return (f"{TIED_OUTPUT!r} is not in the engine's checkpoint: the engine ties it to {tied_to!r} "
                    "(tie_word_embeddings); leave it out")
        shown = ", ".join(repr(n) for n in unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        return (f"{len(unknown)} name(s) the engine's checkpoint does not have: {shown}"
                f"{_prefix_hint(unknown, layout)}")
    for name, spec in given.items():
        have = layout[name]
        same_kind = spec.dtype is None or have.dtype is None or spec.dtype == have.dtype or (
            spec.dtype.is_floating_point and have.dtype.is_floating_point)
        if spec.shape != have.shape or not same_kind:
            fix = (" (an engine keeps the shapes it was started with: for new shapes, such as a resized vocabulary, "
                   "start it from the new checkpoint)") if spec.shape != have.shape else ""
            return f"{name!r} is {spec}, the engine's checkpoint has {have}{fix}"
    return None


def incomplete_group(groups: list[list[str]], names: Iterable[str]) -> tuple[str, str] | None:
    """``(missing name, a name of its group that is present)`` for the first layer group
    (vLLM's ``layerwise_groups``) that ``names`` touch without holding all of: the engine
    rebuilds a layer only from all of its checkpoint tensors, so such an update would leave
    part of a fused layer uninitialized. ``None`` when every touched group is whole."""
    present = set(names)
    for group in groups:
        have = [n for n in group if n in present]
        if have and len(have) != len(group):
            return next(n for n in group if n not in present), have[0]
    return None


def spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(t.shape), t.dtype)
