"""The read-on-access tensor mappings' shared part (tide.target, tide.gguf_tensors, tide.engine.llama)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotation only: tide.target's mappings are importable without torch
    import torch


class TensorMapping(Mapping[str, "torch.Tensor"]):
    """A name -> tensor mapping whose names are the keys of `self._names` (set by the subclass);
    the subclass reads a tensor in `__getitem__`, when it is asked for."""

    _names: Mapping[str, object]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names
