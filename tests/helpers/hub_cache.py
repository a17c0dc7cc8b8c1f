"""A Hugging Face hub cache laid out by the tests as ``huggingface_hub`` lays it out, so that hub names resolve through
the real code path with no network.

The layout (``huggingface_hub``'s "cache-system" guide): ``CACHE/{models|datasets}--ORG--NAME/`` holds ``blobs/``
(each file's bytes under its content hash), ``snapshots/COMMIT/`` (the repository's tree, each file a relative
symlink to its blob) and ``refs/REVISION`` (a text file naming the commit a branch or tag points at).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def write_repo(
    cache: Path, repo_id: str, files: dict[str, bytes], *, repo_type: str = "model", revision: str = "main"
) -> Path:
    """``files`` (path in the repository -> bytes) as one commit of ``repo_id`` in ``cache``, ``revision`` pointing
    at it; the commit's snapshot folder."""
    folder = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()  # 40 hex digits, as a git commit
    snapshot = folder / "snapshots" / commit
    for name, content in files.items():
        blob = folder / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / revision).write_text(commit)
    return snapshot


def files_of(directory: str) -> dict[str, bytes]:
    """A local directory's files (a saved model) as ``write_repo``'s ``files``."""
    root = Path(directory)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, offline: for this process (``huggingface_hub`` reads its settings at import, so they are
    set on its ``constants``) and for the commands a test starts (the environment)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache
