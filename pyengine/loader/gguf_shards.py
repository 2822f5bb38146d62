"""GGUF file naming: split shards (``name-00001-of-00003.gguf``) and picking the model file in a folder."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from candle_vllm.pyengine.loader.errors import ModelLoadError

SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_names(filename: str) -> list[str]:
    """All shard file names of the split GGUF that ``filename`` belongs to (just ``[filename]`` if unsplit)."""
    m = SHARD_RE.match(filename)
    if m is None:
        return [filename]
    count = int(m.group("count"))
    return [f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def local_shards(path: Path) -> list[Path]:
    """The shard files of a local GGUF, in order; a missing shard is an error naming it."""
    files = [path.with_name(n) for n in shard_names(path.name)]
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: missing GGUF shard (the split model {path.name} needs {len(files)} files)")
    return files


def pick_gguf(files: Iterable[Path], where: str) -> list[Path]:
    """The one model among ``files`` (mmproj vision towers aside), as its ordered shard list.

    Several distinct models (e.g. Q4_K_M and Q8_0 side by side) are ambiguous: the error lists them.
    """
    groups: dict[str, list[Path]] = {}
    for f in sorted(files):
        if f.name.lower().startswith("mmproj"):
            continue
        m = SHARD_RE.match(f.name)
        groups.setdefault(m.group("stem") if m else f.stem, []).append(f)
    if not groups:
        raise ModelLoadError(f"{where}: no GGUF model file found")
    if len(groups) > 1:
        names = ", ".join(g[0].name for g in groups.values())
        raise ModelLoadError(f"{where}: several GGUF models ({names}); pick one with --f <file.gguf>")
    first = next(iter(groups.values()))[0]
    return local_shards(first)
