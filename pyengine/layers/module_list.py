"""``nn.ModuleList`` typed by what it holds. torch types a list's items as ``Module``, whose attributes read as
``Tensor | Module``, so every reader of a decoder's layers or a linear's weight methods would need a cast; the
type checker is what catches a wrong call in code only the GPU runs (session 31 lost a GPU call to one)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar, cast

from torch import nn

M = TypeVar("M", bound=nn.Module)


def module_list(modules: Iterable[M]) -> Sequence[M]:
    """The modules registered as an ``nn.ModuleList`` (state dict, ``.to``, ``named_modules``), seen as a
    read-only sequence of their class."""
    return cast("Sequence[M]", nn.ModuleList(modules))
