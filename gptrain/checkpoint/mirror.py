"""Off-node checkpoints: `checkpoint.mirror = URL` (fsspec: file://, s3://, gs://, ...).

    URL/checkpoints/step_00000400/   the files of a published local checkpoint (meta.json last)
    URL/checkpoints/latest           the newest *verified* one, moved only after every file of it
                                     was read back and matched the sha256 meta.json recorded

The main process configures it before training (`configure`: the URL must resolve to a filesystem
whose package is installed, and a probe file must be writable, readable and deletable: otherwise
one line, before anything is trained). After each local publish, `submit(folder)` hands the folder
to one background thread (the step never waits; a newer submission replaces one not yet started);
`wait()` lets the end of a run (or a preemption stop) finish the upload in flight. Remote retention
follows checkpoint.keep_last / keep_every after each verified upload, counting only the run's
timeline as locally (retention.kept), and never deletes the folder `latest` names (the last
verified copy). `fetch_newer(run_dir)`: resume = auto/latest also looks
here, newest first; a remote checkpoint newer than every valid local one (or the local run
directory gone) is downloaded into a .tmp- folder, checked against its meta.json and published
locally; a damaged one is skipped with a warning for the next older one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import threading
from pathlib import Path

from gptrain.checkpoint import folder, retention
from gptrain.errors import UserError, first_line

CHUNK = 8 << 20
_mirror = None  # the configured Mirror of this process (main only), or None


class Mirror:
    def __init__(self, url: str, keep_last: int = 3, keep_every: int = 0) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.keep_last, self.keep_every = keep_last, keep_every
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/") + "/checkpoints"
        self.busy: str | None = None  # the local folder name being uploaded
        self.errors: list[str] = []  # uploads that failed (reported by the loop's caller)
        self._next: Path | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    # --- upload ---------------------------------------------------------------------------------

    def submit(self, path: Path) -> None:
        with self._cv:
            self._next = Path(path)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="gptrain-mirror", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def wait(self) -> None:
        """Until nothing is pending or uploading."""
        with self._cv:
            while self._next is not None or self.busy is not None:
                if self._thread is None or not self._thread.is_alive():
                    return
                self._cv.wait(1.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._next is None:
                    return
                path, self._next, self.busy = self._next, None, self._next.name
            try:
                self.upload(path)
            except Exception as e:  # noqa: BLE001 the run goes on; the local copy is intact
                self.errors.append(f"{path.name}: {first_line(e)}")
                print(
                    f"gptrain: warning: mirror upload of {path.name} to {self.url} failed ({first_line(e)}); the remote `latest` still names the previous copy",
                    file=sys.stderr,
                )
            finally:
                with self._cv:
                    self.busy = None
                    self._cv.notify_all()

    def upload(self, path: Path) -> None:
        """Every file of the local folder, meta.json last; read back and checked; then `latest`."""
        meta = json.loads((path / "meta.json").read_text())
        remote = f"{self.root}/{path.name}"
        self.fs.makedirs(remote, exist_ok=True)
        names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != "meta.json")
        for name in [*names, "meta.json"]:
            self._put(path / name, f"{remote}/{name}")
        why = self.problem(path.name, meta)
        if why:
            raise OSError(f"the uploaded copy does not match meta.json: {why}")
        self.fs.pipe(f"{self.root}/latest", (path.name + "\n").encode())
        self.prune(path.name)

    def _put(self, local: Path, remote: str) -> None:
        self.fs.put_file(str(local), remote)

    def problem(self, name: str, meta: dict | None = None) -> str | None:
        """Why the remote folder `name` cannot be resumed, or None (every file meta.json records
        has its size and sha256)."""
        remote = f"{self.root}/{name}"
        try:
            meta = meta or json.loads(self.fs.cat_file(f"{remote}/meta.json"))
        except (OSError, ValueError) as e:
            return f"no readable meta.json ({first_line(e)})"
        files = meta.get("files") if isinstance(meta, dict) else None
        if not isinstance(files, dict) or not files:
            return "meta.json records no files"
        for fname, want in files.items():
            digest, size = hashlib.sha256(), 0
            try:
                with self.fs.open(f"{remote}/{fname}", "rb") as f:
                    while chunk := f.read(CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
            except OSError as e:
                return f"{fname} is missing ({first_line(e)})"
            if (size, digest.hexdigest()) != (want.get("bytes"), want.get("sha256")):
                return f"{fname} is damaged ({size} bytes, meta.json recorded {want.get('bytes')})"
        return None

    def latest(self) -> str:
        try:
            return self.fs.cat_file(f"{self.root}/latest").decode().strip()
        except (OSError, UnicodeDecodeError):
            return ""

    def steps(self) -> list[int]:
        """Steps of the remote step_ folders, newest first."""
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except OSError:
            return []
        return sorted(
            (
                s
                for n in names
                if (s := retention._step_of(n)) is not None and n.startswith(folder.STEP_PREFIX)
            ),
            reverse=True,
        )

    def prune(self, newest: str) -> None:
        """Remote retention after `newest` was verified and named in `latest`: the local rules
        (retention.kept: keep_last counts the run's timeline, abandoned copies only fill the
        slots it leaves free; keep_every), and never the folder `latest` names."""
        top = retention._step_of(newest)
        folders = {}
        for s in self.steps():
            meta = self._meta(folder.step_dir_name(s))
            folders[s] = meta.get("timeline") if meta else "?"
            if not (folders[s] is None or folder.valid_timeline(folders[s])):
                folders[s] = "?"
        keep = retention.kept(folders, self.timeline(), top, self.keep_last, self.keep_every)
        for s in sorted(folders):
            if s not in keep:
                self.fs.rm(f"{self.root}/{folder.step_dir_name(s)}", recursive=True)

    # --- resume ---------------------------------------------------------------------------------

    def timeline(self) -> dict | None:
        """The remote run's timeline: its timeline.json (written when a run starts, before its
        first upload), else the one of the checkpoint `latest` names; None when it records none."""
        try:
            t = json.loads(self.fs.cat_file(f"{self.root}/{folder.TIMELINE}"))
        except (OSError, ValueError):
            named = self.latest()
            t = self._meta(named).get("timeline") if folder.is_step_name(named) else None
        return t if folder.valid_timeline(t) else None

    def record_timeline(self, timeline: dict) -> None:
        """URL/checkpoints/timeline.json: the timeline the run now trains on (a resume from an
        earlier step is recorded before its first upload, so the mirror never offers the
        checkpoints it left)."""
        if self.timeline() != timeline:
            self.fs.pipe(f"{self.root}/{folder.TIMELINE}", json.dumps(timeline).encode())

    def _meta(self, name: str) -> dict:
        try:
            meta = json.loads(self.fs.cat_file(f"{self.root}/{name}/meta.json"))
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def candidates(self, timeline: dict | None = None) -> list[str]:
        """Remote folders to resume from, newest first: those on `timeline` (see
        retention.in_history; a folder whose meta.json cannot be read is kept, to be skipped
        as damaged), or without one `latest`'s and older ones."""
        named = self.latest()
        top = retention._step_of(named) if folder.is_step_name(named) else None
        names = [folder.step_dir_name(s) for s in self.steps()]
        if timeline is None:
            return [n for n in names if top is None or retention._step_of(n) <= top]
        out = []
        for n in names:
            meta = self._meta(n)
            t = meta.get("timeline") if meta else "?"
            if t == "?" or retention.in_history(timeline, t, retention._step_of(n)):
                out.append(n)
        return out

    def download(self, name: str, run_dir: Path) -> Path:
        root = Path(run_dir) / "checkpoints"
        tmp = root / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for remote in self.fs.ls(f"{self.root}/{name}", detail=False):
            self.fs.get_file(remote, str(tmp / remote.rstrip("/").rsplit("/", 1)[-1]))
        return tmp


def configure(url: str, keep_last: int, keep_every: int) -> Mirror | None:
    """Main process, before training: the mirror, checked to be reachable and writable (one
    UserError otherwise); None without a URL."""
    global _mirror
    _mirror = None
    if not url:
        return None
    fix = "check the URL, the credentials (environment or config of that filesystem) and the network, or leave checkpoint.mirror empty"
    try:
        m = Mirror(url, keep_last, keep_every)
    except ImportError as e:
        raise UserError(
            f"checkpoint.mirror = {url!r} needs a package that is not installed ({first_line(e)}); install it, e.g. pip install s3fs for s3://"
        ) from None
    except (ValueError, OSError) as e:
        raise UserError(f"checkpoint.mirror = {url!r}: {first_line(e)}; {fix}") from None
    probe = f"{m.root}/.gptrain-probe"
    try:
        m.fs.makedirs(m.root, exist_ok=True)
        m.fs.pipe(probe, b"ok")
        ok = m.fs.cat_file(probe) == b"ok"
        m.fs.rm(probe)
    except Exception as e:  # noqa: BLE001 any filesystem's error: credentials, network, permissions
        raise UserError(
            f"checkpoint.mirror = {url!r} is not reachable or not writable ({type(e).__name__}: {first_line(e)}); {fix}"
        ) from None
    if not ok:
        raise UserError(f"checkpoint.mirror = {url!r}: a probe file read back differently; {fix}")
    _mirror = m
    return m


def active() -> Mirror | None:
    return _mirror


def fetch_newer(run_dir: str | Path, local_step: int | None) -> list[str]:
    """Resume: the newest valid remote checkpoint of the run's timeline newer than `local_step`
    (the newest valid local one; None: none) is downloaded, checked and published locally. A
    remote timeline that continues the local one (the run went on elsewhere) is adopted; one that
    contradicts it (neither continues the other) is one UserError before anything is written.
    Returns warnings for damaged remote copies skipped on the way."""
    m, warnings = _mirror, []
    if m is None:
        return warnings
    root = Path(run_dir) / "checkpoints"
    local, remote = retention.current(root), m.timeline()
    timeline = _follow(m, root, local, remote)
    for name in m.candidates(timeline):
        if local_step is not None and retention._step_of(name) <= local_step:
            break
        tmp = m.download(name, run_dir)
        why = retention.problem(tmp)
        if why is None:
            if timeline is not local and timeline is not None:  # the remote went on: follow it
                folder.write_timeline(root, timeline)
            folder.publish(root, name, tmp)
            return [
                *warnings,
                f"resumed from the mirror's copy {m.url}/checkpoints/{name} (newer than every valid local checkpoint)",
            ]
        shutil.rmtree(tmp, ignore_errors=True)
        warnings.append(f"skipped mirror checkpoint {m.url}/checkpoints/{name}: {why}")
    if timeline is not local and timeline is not None and local is not None:
        folder.write_timeline(root, timeline)  # it left local checkpoints: they are not resumed
    return warnings


def _follow(m: Mirror, root: Path, local: dict | None, remote: dict | None) -> dict | None:
    """Which timeline resume follows: the local one when the remote one is the same, older (one
    it descends from) or unrecorded; the remote one when the local one is unrecorded or the remote
    one descends from it; otherwise the two contradict each other: a UserError."""
    if local is None or remote is None:
        return remote if local is None else local
    if remote["id"] == local["id"] or remote["id"] in {a["id"] for a in local["ancestors"]}:
        return local
    if local["id"] in {a["id"] for a in remote["ancestors"]}:
        return remote
    raise UserError(
        f"checkpoint.mirror = {m.url!r}: its history contradicts {root}'s: the mirror is on timeline {remote['id']} (from step {remote.get('from_step')}), this run directory on {local['id']} (from step {local.get('from_step')}), and neither continues the other; nothing was written or deleted; choose with --checkpoint.resume=STEP (a local step), or use another checkpoint.mirror or run.dir"
    )
