"""Start-up, memory and replacement of `stoic serve` on a model file, next to llama-server.

Each round starts `stoic serve --model FILE` (and, with --llama-server, llama-server on the same
file, the order alternating between rounds) and measures:

* ready: seconds from the command to `/health` answering 200 (with --cold, the page cache
  dropped before each start: the model file and every library read from the disk);
* memory: the resident set (RSS, what `ps` shows: shared pages counted in every process that
  maps them) and the proportional set (PSS, `/proc/PID/smaps_rollup`: each shared page split
  between its processes, the machine's real figure) of the server and all its processes, at
  ready and after three requests;
* replacement (stoic only): `kill -9` of the serving worker, then the seconds until a
  one-token completion, sent right after the kill and again on each 5xx (the one the dying
  worker was handed fails), is answered 200 (the warm spare's or the pre-started
  interpreter's load, the shared layouts mapped instead of packed).

Prints a markdown table of medians. Run alone on the machine: the figures are seconds of CPU.

    python benchmarks/startup_bench.py --model qwen2.5-1.5b.Q4_K_M.gguf \\
        --llama-server /path/to/llama-server --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.servers import System, llama_system, model_file, model_flags, stoic_server


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def memory_gib(pid: int) -> tuple[float, float]:
    """RSS and PSS of ``pid``'s tree, GiB."""
    rss = pss = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    kib = int(rest.split()[0])
                    rss += kib if key == "Rss" else 0
                    pss += kib if key == "Pss" else 0
        except OSError:
            continue
    return rss / 2**20, pss / 2**20


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (OSError, TimeoutError):
        return 0, b""


def complete(base: str, model: str, tokens: int) -> int:
    body = json.dumps(
        {"model": model, "prompt": "Once upon a time " * 40, "max_tokens": tokens, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def wait_ready(base: str, proc: subprocess.Popen[bytes], started: float) -> float:
    while get(f"{base}/health")[0] != 200:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        time.sleep(0.05)
    return time.perf_counter() - started


def serving_worker(pid: int) -> int | None:
    for p in tree(pid):
        try:
            if b"(serving)" in Path(f"/proc/{p}/cmdline").read_bytes():
                return p
        except OSError:
            continue
    return None


def drop_caches() -> None:
    """Empty the page cache (root only): the next start reads the model file, and every library
    and Python module it loads, from the disk."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def measure(system: System, *, replace: bool) -> dict[str, float]:
    """Start ``system``, take its figures (with ``replace``, kill -9 its serving worker and time
    the first 200 after it), stop it."""
    started = time.perf_counter()
    system.spawn()
    proc = system.proc
    assert proc is not None
    try:
        row: dict[str, float] = {"ready_s": wait_ready(system.url, proc, started)}
        row["rss_ready"], row["pss_ready"] = memory_gib(proc.pid)
        name = json.loads(get(f"{system.url}/v1/models")[1])["data"][0]["id"]
        for _ in range(3):
            assert complete(system.url, name, 32) == 200
        row["rss_serving"], row["pss_serving"] = memory_gib(proc.pid)
        if replace:
            time.sleep(6)  # the spares and the pre-started interpreter topped up
            worker = serving_worker(proc.pid)
            assert worker is not None, "no serving worker found"
            killed = time.perf_counter()
            os.kill(worker, signal.SIGKILL)
            # a request the dying worker was given fails (5xx): a client retries, as after any
            # executor failure (with --recovery resume none would see it)
            while (status := complete(system.url, name, 1)) != 200:
                assert status >= 500 and time.perf_counter() - killed < 120, status
            row["replaced_s"] = time.perf_counter() - killed
        return row
    finally:
        system.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-server", help="a llama-server binary to measure alongside")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stoic-flags", default="", help="more flags for stoic serve")
    parser.add_argument(
        "--cold", action="store_true", help="drop the page cache before each start (root)"
    )
    args = parser.parse_args()
    model = model_file(args.model)
    work = Path(tempfile.mkdtemp(prefix="startup_bench-"))  # the servers' logs
    stoic = stoic_server(work, "stoic", [*model_flags(model), *args.stoic_flags.split()])
    rows: dict[str, list[dict[str, float]]] = {"stoic": [], "llama-server": []}
    for r in range(args.rounds):
        order = ["stoic", "llama-server"] if r % 2 == 0 else ["llama-server", "stoic"]
        for system in order:
            if args.cold and (system == "stoic" or args.llama_server):
                drop_caches()
            if system == "stoic":
                rows[system].append(measure(stoic, replace=True))
            elif args.llama_server:
                llama = llama_system(work, args.llama_server, model, slots=8)
                rows[system].append(measure(llama, replace=False))
            if rows[system]:
                print(system, {k: round(v, 2) for k, v in rows[system][-1].items()}, flush=True)
    keys = ["ready_s", "rss_ready", "pss_ready", "rss_serving", "pss_serving", "replaced_s"]
    cache = "page cache dropped before each start" if args.cold else "page cache warm"
    print(f"\n{args.model}, {args.rounds} rounds, {cache}, medians (GiB, seconds)\n")
    print("| | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for system, measured in rows.items():
        if measured:
            cells = [
                f"{statistics.median(m[k] for m in measured):.2f}" if k in measured[0] else ""
                for k in keys
            ]
            print(f"| {system} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
