"""A small mutation check of the engine's invariants: does the test suite notice when one breaks?

For each mutation: export the committed tree (``git archive HEAD``) to a temporary directory,
apply one exact textual replacement to one source file there (it must match exactly once, else
the mutation is *stale*), run the chosen tests against that copy (``PYTHONPATH=<copy>`` first, so
the copy's ``stoic`` is imported rather than the venv's editable install of the repository) and
record whether they failed (caught) or passed (survived). A baseline run of every chosen test
on the unmutated copy comes first. Prints a markdown table; exits 1 if any mutation survived,
was stale or the baseline failed.

    .venv/bin/python benchmarks/mutation_check.py [-k NAME_SUBSTRING] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = REPO / ".venv" / "bin" / "python"
CORE = "stoic/scheduler/_core.py"
RECOVERY = "stoic/scheduler/_core_recovery.py"
SCHED = "tests/scheduler/test_scheduler_core.py"
RESUME = "tests/scheduler/test_resume_core.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: node ids, files, ``-k`` expressions


MUTATIONS = (
    Mutation(
        "abort does nothing",
        CORE,
        '            seq.stream.finish("abort")\n',
        "            return seq  # mutant\n",
        (SCHED, RESUME, "-k", "abort"),
    ),
    Mutation(
        "the fence is gone",
        CORE,
        "if inflight is None or (inflight.step_id, inflight.incarnation) != (step_id, incarnation):",
        "if inflight is None:  # mutant",
        (SCHED, "-k", "fenced"),
    ),
    Mutation(
        "the cache drop frees nothing",
        RECOVERY,
        "freed = self.allocator.free_all()",
        "freed = 0  # mutant",
        ("tests/engine/test_prefix_cache.py::test_recovery_drops_the_prefix_cache",),
    ),
    Mutation(
        "partial output has empty text",
        "stoic/scheduler/_sequence.py",
        "PartialOutput(text=self.text, token_ids=tuple(self.output_ids))",
        'PartialOutput(text="", token_ids=tuple(self.output_ids))',
        (SCHED, RESUME, "-k", "partial or fenced_incarnation"),
    ),
    Mutation(
        "partial output drops the last token",
        "stoic/scheduler/_sequence.py",
        "PartialOutput(text=self.text, token_ids=tuple(self.output_ids))",
        "PartialOutput(text=self.text, token_ids=tuple(self.output_ids)[:-1])",
        (SCHED, RESUME, "-k", "partial or fenced_incarnation"),
    ),
    Mutation(
        "_release does not free",
        "stoic/scheduler/_core_blocks.py",
        "        self.allocator.free(seq.seq_id)\n",
        "        pass  # mutant\n",
        (SCHED, "-k", "frees_its_blocks or random_operations"),
    ),
    Mutation(
        "resume keeps num_computed",
        RECOVERY,
        "everyone:  # their blocks were dropped with the cache\n"
        "            self._release(seq)\n            seq.num_computed = 0\n",
        "everyone:  # their blocks were dropped with the cache\n"
        "            self._release(seq)\n            pass  # mutant\n",
        (
            RESUME,
            SCHED,
            "tests/engine/test_resume.py::test_streams_resume_with_exactly_their_fault_free_text[thread-kinds0]",
        ),
    ),
    Mutation(
        "strikes never reset on a clean step",
        CORE,
        "seq.strikes = seq.solo_failures = 0  # a clean step",
        "pass  # mutant: a clean step",
        (RESUME,),
    ),
)


@dataclass(frozen=True)
class Outcome:
    caught: str  # "yes", "no", "stale", "timeout"
    seconds: float
    tail: str


def export_tree(dest: Path) -> None:
    """The committed tree (HEAD), not the working tree others are editing."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def copy_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import(copy: Path) -> str:
    """Where ``stoic`` is imported from inside the copy; must be the copy's (not the venv's)."""
    code = "import stoic; print(stoic.__file__)"
    out = subprocess.run(
        [str(PYTHON), "-c", code], cwd=copy, env=copy_env(copy), capture_output=True, text=True
    )
    where = out.stdout.strip()
    if not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"stoic imported from {where!r}, not from the copy {copy}: {out.stderr}")
    return where


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    cmd = [str(PYTHON), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(
            cmd, cwd=copy, env=copy_env(copy), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, "timed out"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    failed = [line for line in lines if line.startswith("FAILED ")]
    return proc.returncode, " / ".join([*failed[:1], *lines[-1:]])


def check(mutation: Mutation | None, tests: tuple[str, ...], timeout: float) -> Outcome:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stoic-mutant-") as tmp:
        copy = Path(tmp)
        export_tree(copy)
        if mutation is None:
            print(f"stoic imported from {check_import(copy)}", file=sys.stderr)
        else:
            source = copy / mutation.path
            text = source.read_text()
            if text.count(mutation.old) != 1:
                return Outcome("stale", 0.0, f"matches {text.count(mutation.old)} times")
            source.write_text(text.replace(mutation.old, mutation.new))
        code, tail = run_tests(copy, tests, timeout)
    seconds = time.monotonic() - start
    if code is None:
        return Outcome("timeout", seconds, tail)
    if code == 5:  # no tests collected: the selection is wrong, not the mutation caught
        return Outcome("no tests", seconds, tail)
    return Outcome("yes" if code != 0 else "no", seconds, tail)


def baseline_tests(mutations: tuple[Mutation, ...]) -> tuple[str, ...]:
    """Every file or node id the mutations select (their ``-k`` filters dropped), once."""
    args: list[str] = []
    for m in mutations:
        args += [t for i, t in enumerate(m.tests) if t != "-k" and m.tests[i - 1 : i] != ("-k",)]
    return tuple(dict.fromkeys(args))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the mutations whose name contains this")
    parser.add_argument("--timeout", type=float, default=600.0, help="per pytest run, seconds")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    chosen = tuple(m for m in MUTATIONS if args.k in m.name)
    started = time.monotonic()
    rows: list[tuple[str, str, str, str, float]] = []
    ok = True
    if not args.no_baseline:
        tests = baseline_tests(chosen)
        base = check(None, tests, args.timeout)
        ok = base.caught == "no"
        verdict = "passed" if ok else f"FAILED ({base.caught})"
        rows.append(("(baseline, unmutated)", "-", " ".join(tests), verdict, base.seconds))
        if not ok:
            print(f"baseline failed: {base.tail}", file=sys.stderr)
    for m in chosen:
        result = check(m, m.tests, args.timeout)
        print(f"{m.name}: caught={result.caught} ({result.tail})", file=sys.stderr)
        rows.append((m.name, m.path, " ".join(m.tests), result.caught, result.seconds))
        ok = ok and result.caught == "yes"
    print("| mutation | file | tests run | caught | seconds |")
    print("|---|---|---|---|---|")
    for name, path, tests_run, caught, seconds in rows:
        print(f"| {name} | `{path}` | `{tests_run}` | {caught} | {seconds:.1f} |")
    print(f"\ntotal: {time.monotonic() - started:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    shutil.which("git") or sys.exit("git not found")
    sys.exit(main())
