"""Fixtures of the reliability tests that change the machine: a small tmpfs (a disk that really fills)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh directory on a tmpfs of `size` (mount's syntax: "64k", "2m"); the
    `.resize(size)` of the returned path remounts it (tmpfs keeps its files), and every mount is unmounted
    at the end. Mounting needs root (CI runs as root): without it the test is skipped, saying so; a mount
    refused to root fails the test."""
    mounted = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (CI runs the suite as root)")
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.fail(f"mount -t tmpfs -o size={size} {where} failed: {r.stderr.strip()}")
        mounted.append(where)
        return where

    def resize(where: Path, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True, capture_output=True)

    mount.resize = resize
    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
