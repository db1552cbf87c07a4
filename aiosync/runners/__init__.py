"""Optional trainer / explorer loop skeletons with step hooks (S1)."""

from .loops import ExplorerLoop, TrainerLoop

__all__ = ["TrainerLoop", "ExplorerLoop"]
