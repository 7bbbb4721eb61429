"""Per-matrix A/B of the quantised products: the kernels built from a git revision's C sources
(A, the baseline) against the working tree's (B), on the real blocks of GGUF files.

For each file, the matrices a decode layer multiplies (the fused q/k/v stack, o, the fused
gate/up stack, down; each part on its own type, as stoic binds them) of every layer, and the
output head: each matrix of all layers multiplied one after the other (so that none stays in
cache) by ``--rows`` rows of activations; A and B alternate (A B, B A, ...) for ``--rounds``
rounds, so the noise of a shared machine hits each alike. Prints a table: per file, matrix and
rows, the types, the median microseconds per layer (the head: per call) of A and B and the
median of the rounds' B / A. One thread by default, timed by its CPU time (``--threads``).

    python benchmarks/kquant_bench.py --baseline HEAD FILE.gguf [FILE.gguf ...] [--rows 1 32]

Also checks that A and B compute the same products within float32 rounding of each other (B's
products of one or two rows take int8 activations where its kernels have them, as the default
mode binds them: those differ by design; ``--float-rows`` binds B without).

``--step 1 32``: the whole decode step instead (step_bench.py's ``Stream``: that many sequences
of 128 tokens, 40 greedy steps), the model loaded twice, once on A's kernels and once on B's,
steps alternating three at a time; per file and batch the median step of each, B / A, and
whether both decoded the same tokens (they may not: the sums' order differs, and a near-tie of
two logits can flip; float32 rounding either way; and B's int8 activations). ``--dtype`` is the
models' (``auto``, the default mode: B's steps of one or two tokens on int8 activations where
its kernels have them; ``float32``: the float path on both sides).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from stoic.kernels import _build, _qkernels  # noqa: E402
from stoic.kernels._qkernels import Kernels, Product  # noqa: E402

#: a decode layer's products, each the GGUF tensors stacked into it (stoic's fused layout)
MATRICES = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


def build(files: dict[str, bytes], into: Path) -> Kernels:
    """The kernels built from ``files`` (name -> bytes, the C files and headers) as stoic builds
    its own (:func:`stoic.kernels._build.build`: each ``.c`` file an object, one library)."""
    import ctypes

    cc = _build.compiler()
    assert cc is not None, "no C compiler"
    target = into / _build.LIBRARY
    _build.build(cc, files, target, _build.flags())
    return Kernels(target, ctypes.CDLL(str(target)))


#: the order in which revisions from before the kernels became a library of translation units
#: joined their C files into one (those without ``stoic_kernels.h``)
ONE_UNIT = (
    "_qkernels.c", "_kquants.c", "_int8rows.c", "_gemm8.c", "_cops.c", "_bf16fixed.c",
    "_rows_attention.c", "_chunk_attention.c",
)  # fmt: skip


def source_at(rev: str) -> dict[str, bytes]:
    """The kernels' C files and headers at git revision ``rev`` (``stoic/kernels``, or
    ``stoic/model`` before the package split). A revision from before the kernels became a
    library had one translation unit: its files are joined in :data:`ONE_UNIT`'s order, and the
    working tree's ``_constants.c`` (with ``stoic_kernels.h``) is built beside them for the
    constants today's bindings read from the library (those revisions had the same numbers in
    Python)."""
    for folder in ("stoic/kernels", "stoic/model"):
        listed = subprocess.run(
            ["git", "ls-tree", "--name-only", f"{rev}:{folder}"],
            cwd=ROOT, capture_output=True, text=True, check=False,
        )  # fmt: skip
        names = [n for n in listed.stdout.split() if n.endswith((".c", ".h"))]
        if listed.returncode == 0 and names:
            break
    else:
        raise SystemExit(f"no C kernels at {rev}")
    files = {
        name: subprocess.run(
            ["git", "show", f"{rev}:{folder}/{name}"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        for name in names
    }
    if "stoic_kernels.h" in files:
        return files
    today = _build.sources()
    return {
        "_qkernels.c": b"\n".join(files[n] for n in ONE_UNIT if n in files),
        "_constants.c": today["_constants.c"],
        "stoic_kernels.h": today["stoic_kernels.h"],
    }


def tensors(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """``name -> (GGML type, uint8 [rows, bytes] blocks)`` of the file's quantised matrices."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind in _qkernels.GGML_TYPES:
            out[t.name] = (kind, torch.from_numpy(t.data.copy()).reshape(int(t.shape[1]), -1))
    return out


def bind(kernels: Kernels, parts: list[tuple[str, torch.Tensor]], int8: bool) -> Product:
    """The product stoic binds for ``parts``; ``int8``: with int8 one-row activations where
    the kernels have them (the default mode's fast dtype; a baseline without them ignores it)."""
    if len(parts) == 1:
        return kernels.bind(parts[0][0], parts[0][1], None, int8_rows=int8)
    if len({kind for kind, _ in parts}) == 1:
        return kernels.bind(parts[0][0], torch.cat([b for _, b in parts]), None, int8_rows=int8)
    return kernels.bind_stack(parts, None, int8_rows=int8)


def matrices(path: Path) -> dict[str, list[list[tuple[str, torch.Tensor]]]]:
    """``matrix -> per layer, its parts``; the head (the tied embedding if no output.weight)."""
    found = tensors(path)
    layers = 1 + max(int(n.split(".")[1]) for n in found if n.startswith("blk."))
    out: dict[str, list[list[tuple[str, torch.Tensor]]]] = {}
    for name, parts in MATRICES.items():
        out[name] = [[found[f"blk.{i}.{p}.weight"] for p in parts] for i in range(layers)]
    out["head"] = [[found.get("output.weight", found["token_embd.weight"])]]
    return out


def time_pass(products: list[Product], x: torch.Tensor) -> float:
    """Seconds to multiply ``x`` by each product: the thread's CPU time when the products run
    on this thread alone (``--threads 1``: time other processes take is not counted, which on
    a busy 2-core machine is the difference between noise and a measurement), else wall time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    started = clock()
    for p in products:
        p(x)
    return clock() - started


def steps(files: list[Path], a: Kernels, b: Kernels, batches: list[int], dtype: str) -> None:
    """The decode-step A/B (``--step``)."""
    import step_bench

    from stoic.model import load_model
    from stoic.worker import ModelRunner

    if torch.get_num_threads() == 1:  # Stream times with perf_counter: make it CPU time
        step_bench.time = _CpuClock()  # type: ignore[assignment]
    print("| file | batch | A ms/step | B ms/step | B/A | same tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for path in files:
        runners = {}
        original = _qkernels.load_kernels
        try:
            for name, lib in (("A", a), ("B", b)):
                _qkernels.load_kernels = lambda root, lib=lib: lib  # type: ignore[misc]
                runners[name] = ModelRunner(load_model(str(path), dtype=dtype, device="cpu"))
        finally:
            _qkernels.load_kernels = original
        for batch in batches:
            streams = {n: step_bench.Stream(r, batch, 128, 40) for n, r in runners.items()}
            for s in streams.values():
                s.step()
                s.times.clear()
            order = list(streams)
            while streams["A"].generated < 38:
                for n in order:
                    for _ in range(3):
                        streams[n].step()
                order.reverse()
            ta = statistics.median(streams["A"].times)
            tb = statistics.median(streams["B"].times)
            same = streams["A"].tokens == streams["B"].tokens
            print(
                f"| {path.name} | {batch} | {ta * 1e3:.2f} | {tb * 1e3:.2f} | {tb / ta:.3f} "
                f"| {same} |",
                flush=True,
            )


class _CpuClock:
    """``time`` for step_bench with ``perf_counter`` reading this thread's CPU time."""

    def __getattr__(self, name: str) -> object:
        return time.thread_time if name == "perf_counter" else getattr(time, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--baseline", default="HEAD", help="git revision of A's C sources")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", nargs="*", default=None, help="matrices to measure")
    parser.add_argument("--threads", type=int, default=1, help="1: CPU time; more: wall time")
    parser.add_argument("--step", type=int, nargs="*", default=None, help="decode-step batches")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="--step: the model's --dtype (auto: the default mode, whose one-row products take "
        "int8 activations where the kernels have them; float32: the float path on both sides)",
    )
    parser.add_argument(
        "--float-rows",
        action="store_true",
        help="per matrix: B's one-row products on float32 activations (as --dtype float32)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        a = build(source_at(args.baseline), Path(tmp) / "a")
        b = build(_build.sources(), Path(tmp) / "b")
        if args.step:
            steps(args.files, a, b, args.step, args.dtype)
            return
        print(f"A: {args.baseline}; B: the working tree. threads {torch.get_num_threads()}")
        print("| file | matrix | types | rows | A us | B us | B/A |")
        print("|---|---|---|---:|---:|---:|---:|")
        for path in args.files:
            for name, layers in matrices(path).items():
                if args.only and name not in args.only:
                    continue
                pa = [bind(a, parts, False) for parts in layers]
                pb = [bind(b, parts, not args.float_rows) for parts in layers]
                kinds = ", ".join(sorted({p.kind for p in pa}))
                for m in args.rows:
                    x = torch.randn(m, pa[0].cols, generator=torch.Generator().manual_seed(m))
                    ya, yb = pa[0](x), pb[0](x)
                    scale = (ya.abs().max() + 1e-30).item()
                    if not torch.allclose(ya, yb, rtol=1e-4, atol=1e-5 * scale):
                        why = " (B's int8 activations: expected)" if pb[0].int8_rows else ""
                        print(f"  note: {path.name} {name} rows {m}: A and B differ{why}")
                    ta, tb = [], []
                    for r in range(args.rounds + 1):
                        first, second = (pa, pb) if r % 2 == 0 else (pb, pa)
                        t1, t2 = time_pass(first, x), time_pass(second, x)
                        if r == 0:
                            continue  # warm-up
                        ta.append(t1 if first is pa else t2)
                        tb.append(t2 if first is pa else t1)
                    ma = statistics.median(ta) / len(pa) * 1e6
                    mb = statistics.median(tb) / len(pb) * 1e6
                    ratio = statistics.median(y / z for y, z in zip(tb, ta, strict=True))
                    print(
                        f"| {path.name} | {name} | {kinds} | {m} | {ma:.0f} | {mb:.0f} "
                        f"| {ratio:.2f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
