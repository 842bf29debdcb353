"""`gptrain prepare` at scale: a generated Parquet corpus of FineWeb-like documents, GPT-2 tokenizer.

    .venv/bin/python benchmarks/cpu/bench_prepare.py [--mb 250 500] [--workers 2] [--data /tmp/corpus]
    .venv/bin/python benchmarks/cpu/bench_prepare.py --mb 250 1000 --median-chars 650   # >= 1M docs/GB
    .venv/bin/python benchmarks/cpu/bench_prepare.py --layout-docs 1e6 4e6 8e6   # memory only

For each corpus size (MB of UTF-8 text; documents are slices of tiny shakespeare, log-normal
lengths with a median of --median-chars characters (default 2,400; 650 makes ~1.05M documents
per GB, the >= 1M-document target), in Parquet files of 125 MB with row groups of 1,000
documents, as datatrove writes FineWeb's):
- tokenize-only: tiktoken's encode_ordinary_batch on the same row groups with the same number of
  processes, nothing written (the reference rate);
- end to end: `gptrain prepare` in a subprocess: wall time, the main process's own CPU time per
  token (what would bound 32 workers), peak resident memory of the whole process tree (sampled
  every 20 ms), bytes written (wchar of the tree) over the prepared folder's size (its tokens,
  span tables and document indexes);
- a kill -9 of the whole prepare at ~50% of the parts, then the same command: its time over a
  full prepare's.
Prints a markdown table. --layout-docs N...: only what follows the parts (val split, shuffle,
span tables, indexes) for N synthetic documents, without tokenizing: the main process's peak
resident memory per N, in a fresh process each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
GPT2_DIR = REPO.parent / "shared" / "data" / "gpt2"  # used when GPTRAIN_GPT2_DIR is unset


def make_corpus(folder: Path, mb: int, median: int = 2400) -> tuple[list[Path], int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "done.json"
    if done.is_file():
        info = json.loads(done.read_text())
        return [folder / f for f in info["files"]], info["docs"]
    text = SHAKESPEARE.read_text()
    rng = np.random.default_rng(0)
    files, docs, total, target = [], 0, 0, mb * 1_000_000
    per_file = 125_000_000
    while total < target:
        rows, size = [], 0
        while size < min(per_file, target - total):
            n = int(min(rng.lognormal(np.log(median), 0.9), 100_000))
            a = int(rng.integers(0, len(text) - n))
            rows.append(text[a : a + n])
            size += n
        path = folder / f"{len(files):03d}.parquet"
        pq.write_table(pa.table({"text": rows}), path, row_group_size=1000)
        files.append(path)
        docs, total = docs + len(rows), total + size
    done.write_text(json.dumps({"files": [f.name for f in files], "docs": docs}))
    return files, docs


def _encode_group(args) -> int:
    path, group = args
    import pyarrow.parquet as pq

    from gptrain.data.tokenizers import load_tokenizer

    enc = load_tokenizer("gpt2").enc
    texts = pq.ParquetFile(path).read_row_group(group, columns=["text"]).column(0).to_pylist()
    return sum(len(t) for t in enc.encode_ordinary_batch(texts, num_threads=1))


def tokenize_only(files: list[Path], workers: int) -> tuple[float, int]:
    import pyarrow.parquet as pq

    tasks = [(str(f), g) for f in files for g in range(pq.ParquetFile(f).metadata.num_row_groups)]
    with get_context("fork").Pool(workers) as pool:
        pool.map(_encode_group, tasks[:workers])  # warm: tokenizer loaded in every process
        t0 = time.perf_counter()
        tokens = sum(pool.map(_encode_group, tasks, chunksize=1))
        return time.perf_counter() - t0, tokens


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


def wchar() -> int:
    """Bytes written by this process and its reaped children."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


RUNNER = """
import json, resource, sys, time
from gptrain.data.prepare import prepare
t0 = time.perf_counter()
m = prepare(sys.argv[2:], sys.argv[1], tokenizer="gpt2", workers=int(sys.argv[1].rsplit("-w", 1)[1]), progress=False)
me = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": time.perf_counter() - t0, "main_cpu": me.ru_utime + me.ru_stime,
                  "tokens": m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]}))
"""


def run_prepare(out: Path, files, workers: int, kill_at: float | None = None) -> dict:
    cmd = [sys.executable, "-c", RUNNER, f"{out}-w{workers}", *map(str, files)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    io0, peak = wchar(), [0]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, start_new_session=True)
    parts = out.parent / f".{out.name}-w{workers}.parts"
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            if kill_at is not None and len(list(parts.glob("*.json"))) >= kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stdout, _ = proc.communicate()
    stop.set()
    thread.join()
    if kill_at is not None and proc.returncode != 0:
        return {"killed": True}
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    folder = [p for p in Path(f"{out}-w{workers}").rglob("*") if p.is_file()]
    stored = sum(p.stat().st_size for p in folder)  # parts (the tokens), span tables, indexes
    return {**result, "peak_rss": peak[0], "written": wchar() - io0, "folder_bytes": stored}


LAYOUT = """
import resource, shutil, sys, tempfile
from pathlib import Path
import numpy as np
from gptrain.data.assemble import Pieces, split_orders, write_splits
n, per = int(float(sys.argv[1])), 1000
records = [{"cont": False, "split": 0, "pieces": per, "tokens": 600 * per} for _ in range(n // per)]
lengths = lambda k: np.random.default_rng(k).integers(20, 1200, size=per)  # ~600 tokens each
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
p = Pieces.from_parts(records, lengths)
orders = split_orders(p, 0.1, None, 100_000_000, 1337, 1337)  # what prepare does after the parts
out = Path(tempfile.mkdtemp())
write_splits(out, p, orders, 100_000_000)
shutil.rmtree(out)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def layout_memory(sizes: list[float]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    print("\n| documents | main process peak growth | per document |\n| ---: | ---: | ---: |")
    for n in sizes:
        out = subprocess.run([sys.executable, "-c", LAYOUT, str(n)], env=env, capture_output=True, text=True, check=True)  # fmt: skip
        grew = int(out.stdout.strip().splitlines()[-1])
        print(f"| {int(n):,} | {grew / 2**20:.0f} MiB | {grew / n:.0f} B |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[250, 500])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--median-chars", type=int, default=2400, help="documents' median length")
    parser.add_argument("--data", default=None, help="where the generated corpora are kept")
    parser.add_argument("--layout-docs", type=float, nargs="+", help="only the layout's memory")
    args = parser.parse_args()
    if args.layout_docs:
        return layout_memory(args.layout_docs)
    import pyarrow.parquet as pq

    if GPT2_DIR.is_dir():
        os.environ.setdefault("GPTRAIN_GPT2_DIR", str(GPT2_DIR))
    data = Path(args.data or tempfile.gettempdir()) / "gptrain-bench-prepare"
    rows = []
    for mb in args.mb:
        name = f"corpus-{mb}mb" + (f"-{args.median_chars}" if args.median_chars != 2400 else "")
        files, docs = make_corpus(data / name, mb, args.median_chars)
        n_groups = sum(pq.ParquetFile(f).metadata.num_row_groups for f in files)
        ref_s, tokens = tokenize_only(files, args.workers)
        with tempfile.TemporaryDirectory(dir=data) as tmp:
            full = run_prepare(Path(tmp) / "full", files, args.workers)
            run_prepare(Path(tmp) / "killed", files, args.workers, kill_at=n_groups / 2)
            rerun = run_prepare(Path(tmp) / "killed", files, args.workers)
        rows.append((mb, docs, tokens, ref_s, full, rerun))
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "?")  # fmt: skip
    print(f"\n{cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.workers} workers, GPT-2 tokenizer\n")  # fmt: skip
    print("| corpus | documents | tokens | tokenize-only tok/s | prepare tok/s | ratio | main CPU ns/token | main's capacity / 32 workers' rate | peak RSS | written / prepared folder | rerun after kill -9 at 50% |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mb, docs, tokens, ref_s, full, rerun in rows:
        ref_rate, rate = tokens / ref_s, full["tokens"] / full["wall"]
        main_ns = full["main_cpu"] / full["tokens"] * 1e9  # includes start-up (imports, tokenizer)
        demand_32 = 32 * ref_rate / args.workers  # tokens/s 32 workers would hand to the main
        headroom = 1e9 / main_ns / demand_32
        print(f"| {mb} MB | {docs:,} | {tokens:,} | {ref_rate / 1e6:.2f}M | {rate / 1e6:.2f}M | {rate / ref_rate:.2f}x | {main_ns:.1f} | {headroom:.1f}x | {full['peak_rss'] / 2**30:.2f} GiB | {full['written'] / full['folder_bytes']:.2f}x | {rerun['wall'] / full['wall']:.2f}x |")  # fmt: skip
    if len(rows) >= 2:  # the main's CPU per extra token (start-up costs cancel out)
        f0, (_, _, t1, r1, f1, _) = rows[0][4], rows[-1]
        slope = (f1["main_cpu"] - f0["main_cpu"]) / (f1["tokens"] - f0["tokens"])
        demand_32 = 32 * (t1 / r1) / args.workers
        keeps_up = f"{1 / slope / 1e6:.0f}M tok/s" if slope > 0 else "any rate (no measurable cost)"
        print(f"\nmain process: {slope * 1e9:.2f} ns CPU per extra token (between the sizes): it keeps up with {keeps_up}, vs {demand_32 / 1e6:.0f}M tok/s from 32 workers at this machine's per-worker rate")  # fmt: skip


if __name__ == "__main__":
    main()
