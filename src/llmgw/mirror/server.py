"""The mirror's byte listener: weight files and version manifests served from the mirror's directory, with
names still being mirrored (`llmgw mirror add`, in `.staging`) answered 409 "not ready yet". The app itself
is `weights/files_app.py`, shared with the nodes' peer listeners.

It is separate from the admin API because every node needs it and the admin port must be closeable.
"""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette

from llmgw.mirror.staging import pending
from llmgw.weights.files_app import create_files_app, file_sha256, manifest, resolve

__all__ = ["create_mirror_app", "file_sha256", "manifest", "resolve"]


def create_mirror_app(root: Path, metrics=None) -> Starlette:
    return create_files_app(root, metrics, pending=lambda: pending(root))
