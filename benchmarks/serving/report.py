"""The run's report (``serving-report.md``: targets, tables, engine overhead, notes), the plot,
and the summary printed at the end of a run."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import harness.workload as eb
from harness.cpu import cpu_flags, cpu_model, mem_gib, versions
from harness.load import Result
from harness.servers import BLOCK_SIZE, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, NUM_KV_BLOCKS

from . import CONCURRENCY, MAX_OTHER_CPU
from .bench import Bench
from .overhead import kernel_view, profile_section
from .tables import api_table, find, ratio, results_table, system_rank


def targets(bench: Bench) -> list[tuple[str, str, str, str]]:
    """(measure, target, measured, verdict) rows."""
    rows: list[tuple[str, str, str, str]] = []

    def add(
        name: str,
        target: str,
        value: float | None,
        fmt: str,
        passes: Callable[[float], bool] | None = None,
    ) -> None:
        """One row; ``passes`` judges a measured value (none: an "(info)" row, no verdict)."""
        shown = "-" if value is None else format(value, fmt)
        ok = None if value is None or passes is None else passes(value)
        verdict = "n/a" if ok is None else ("met" if ok else "**missed**")
        rows.append((name, target, shown, verdict))

    def speed(a: Result | eb.Row | None, b: Result | eb.Row | None) -> float | None:
        """``a``'s tokens/s over ``b``'s."""
        return ratio(a.tokens_per_s if a else None, b.tokens_per_s if b else None)

    top = max(CONCURRENCY)
    s32, t32 = find(bench.results, "stoic serve", top), find(bench.results, "transformers", top)
    label = f"mixed c={top}: stoic / transformers serve tokens/s"
    add(label, ">= 1.8x", speed(s32, t32), ".2f", lambda v: v >= 1.8)
    tt = ratio(s32.ttft(0.5) if s32 else None, t32.ttft(0.5) if t32 else None)
    label = f"mixed c={top}: stoic / transformers serve TTFT p50"
    add(label, "<= 0.33x", tt, ".3f", lambda v: v <= 1 / 3)
    l32 = find(bench.results, "llama.cpp", top)
    if l32 is not None:
        label = f"mixed c={top}: stoic / llama.cpp server tokens/s (no request failed)"
        clean = l32.errors == 0 and (s32 is None or s32.errors == 0)
        add(label, "> 1x", speed(s32, l32) if clean else None, ".2f", lambda v: v > 1)
    api = {(r.system, r.workload): r for r in bench.api_rows}
    steady = api.get(("stoic (Python API)", "steady decode"))
    loop = api.get(("torch decode loop (ceiling)", "steady decode"))
    label = "steady decode: stoic / bare torch loop"
    add(label, ">= 80%", speed(steady, loop), ".1%", lambda v: v >= 0.8)
    c1 = api.get(("stoic (Python API)", "mixed"))
    gen = api.get(("transformers generate (one at a time)", "mixed"))
    label = "c=1 (Python API): stoic / transformers generate tokens/s"
    add(label, ">= 0.90x", speed(c1, gen), ".2f", lambda v: v >= 0.9)
    h1 = find(bench.results, "stoic serve", 1)
    add("c=1 (HTTP): stoic serve / transformers generate tokens/s", "(info)", speed(h1, gen), ".2f")
    share = s32.execute_share if s32 else None
    label = f"engine overhead at c={top}: wall time the executor is not inside a step (timed)"
    add(label, "< 5%", None if share is None else 1 - share, ".1%", lambda v: v < 0.05)
    if bench.profile:
        inputs = bench.profile.executor["step inputs"] + bench.profile.executor["sampling"]
        label = f"  ... plus step inputs and sampling inside the step (py-spy, c={top})"
        add(label, "(info)", inputs, ".1%")
    exe = next((m for name, m, _ in kernel_view(bench) if name.startswith("stoic-executor")), None)
    label = f"engine overhead at c={top}: executor thread off a CPU (kernel)"
    add(label, "(info)", None if exe is None else 1 - exe[0], ".1%")
    ov = bench.profile.overhead if bench.profile else None
    add(f"engine overhead at c={top}: py-spy samples outside forward+sampling", "(info)", ov, ".1%")
    ceil32 = find(bench.results, "torch", top)
    add(f"mixed c={top}: stoic serve / decode-only ceiling", "(info)", speed(s32, ceil32), ".1%")
    return rows


def llama_bullet(bench: Bench) -> str:
    """The systems-list entry for llama.cpp's server (empty when it was not measured)."""
    if bench.llama is None:
        return ""
    argv, version = bench.llama
    shown = " ".join(["llama-server", *argv[1:]])
    shown = shown.replace(argv[argv.index("-m") + 1], "<the default GGUF file>")
    return (
        f"- `{shown}` ({version}): llama.cpp's own server, continuous batching over "
        f"{max(CONCURRENCY)} parallel slots, on the GGUF file itself, so its weights stay 4-bit "
        "(Q4_1) where stoic and transformers run them de-quantised to bfloat16 (its home ground); "
        "`ignore_eos` per request;\n"
    )


def plot(bench: Bench, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = sorted({r.system for r in bench.results}, key=system_rank)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        rows = sorted((r for r in bench.results if r.system == name), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in rows]
        style = "--" if name.startswith("torch") else "-"
        ax1.plot(xs, [r.tokens_per_s for r in rows], style, marker="o", label=name)
        if not name.startswith("torch"):
            ax2.plot(xs, [r.ttft(0.5) or float("nan") for r in rows], marker="o", label=name)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "TTFT p50 (s, log)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
    ax2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.legend(fontsize=8)
    fig.suptitle(
        f"SmolLM2-135M-Instruct, bfloat16, {os.cpu_count()} CPU cores: mixed prompts, "
        f"max_tokens {bench.s.max_tokens}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def variants_table(bench: Bench) -> list[str]:
    lines = [
        "| measurement | batch | prompt tokens | new tokens | dtype | SDPA (tokens/s) | "
        "eager (tokens/s) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for kind, spec, v in bench.variants:
        what = "ceiling (HTTP phase)" if spec.get("new_tokens") == bench.s.max_tokens else kind
        if spec.get("prompt_len") == 128 and spec.get("new_tokens") == 128:
            what = "steady decode"
        elif spec.get("new_tokens") == 32:
            what = "dtype check"
        lines.append(
            f"| {what} | {spec['batch']} | {spec['prompt_len']} | {spec['new_tokens']} | "
            f"{spec['dtype']} | {v.get('sdpa', 0):.1f} | {v.get('eager', 0):.1f} |"
        )
    return lines


def report(bench: Bench, command: str, png: Path, docs: Path) -> str:
    top = max(CONCURRENCY)
    tserve = find(bench.results, "transformers", top)
    tname = tserve.system if tserve else "transformers serve (not measured)"
    rows = targets(bench)
    target_lines = ["| measure | target | measured | verdict |", "|---|---|---:|---|"]
    target_lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    dtype_lines = ["| dtype | batch | tokens/s |", "|---|---:|---:|"]
    dtype_lines += [f"| {d} | {b} | {t:.1f} |" for d, b, t in bench.dtype_rows]
    ratio_bf16 = {
        b: ratio(
            next((t for d, bb, t in bench.dtype_rows if d == "bfloat16" and bb == b), None),
            next((t for d, bb, t in bench.dtype_rows if d == "float32" and bb == b), None),
        )
        for b in (1, 32)
    }
    bf16_text = ", ".join(
        f"{v:.2f}x float32 at batch {b}" for b, v in ratio_bf16.items() if v is not None
    )
    elapsed = time.time() - bench.started
    all_notes = list(bench.notes)
    if bench.disturbed:
        all_notes.append(
            f"Measurements during which other processes took over {MAX_OTHER_CPU:.0%} of the CPU "
            "were repeated after waiting for quiet (the least disturbed run is kept): "
            + "; ".join(bench.disturbed)
            + "."
        )
    notes = "\n".join(f"- {n}" for n in all_notes)
    rel_png = os.path.relpath(png, docs)
    per_level = ", ".join(f"{bench.s.requests[c]} at c={c}" for c in CONCURRENCY)
    generated = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"""{SECTION_TITLE}

Generated by `benchmarks/serving_bench.py` in one run of {elapsed / 60:.1f} minutes ({generated}):

```
{command}
```

`--quick` runs fewer requests (a smoke test); `--url http://host:port --model NAME` drives any
OpenAI-compatible endpoint on its own; `--llama-server PATH` adds llama.cpp's server. The tools
it needs come with `pip install -e '.[bench]'` (transformers serve's FastAPI/uvicorn, matplotlib,
py-spy).

### Machine and software

- CPU: {cpu_model()}, {os.cpu_count()} cores ({cpu_flags()}); {mem_gib()} of memory; no GPU.
- {versions()}.
- Model: the default SmolLM2-135M-Instruct (the GGUF file de-quantised once into
  `{bench.model_dir}`), **bfloat16** for every system. Why bfloat16: on this CPU (AVX512-BF16, no
  AMX) the bare decode loop runs {bf16_text} (dtype table below), which is also why stoic's
  `--dtype auto` picks bfloat16 on CPUs with native bf16 instructions.
- Load average before / after the run: {" ".join(bench.load_before)} /
  {" ".join(bench.load_after)}. The machine is shared: every measurement records `other CPU`, the
  share of the machine's CPU that processes other than the benchmark and its servers used
  meanwhile; above {MAX_OTHER_CPU:.0%} the measurement is repeated once it is quiet again.

### Targets

{chr(10).join(target_lines)}

### Mixed prompts over HTTP

{per_level} requests: the first N of `harness.workload.mixed_prompts(seed=0)` (chat messages of 8-320
random words; {bench.prompt_range[0]}-{bench.prompt_range[1]} prompt tokens, mean
{bench.prompt_len}), each user message prefixed with a tag new for every pass (`[pass N] `, so
no server's prefix cache can reuse an earlier pass's prompts: stoic's, on by default, shares only
what the requests of one pass share, the chat template's system prompt, one 16-token block),
streamed (`/v1/chat/completions`, SSE), greedy, `max_tokens`
{bench.s.max_tokens} with EOS ignored (stoic: `ignore_eos`; transformers serve: a per-request
`generation_config` with `eos_token_id: -1`), from C closed-loop clients. The servers, both up for
the whole phase and idle when not measured; at each level every system is measured in turn, the
order rotating from level to level:

- `stoic serve --model default --dtype bfloat16 --executor thread --block-size {BLOCK_SIZE} --num-kv-blocks
  {NUM_KV_BLOCKS} --max-num-batched-tokens {MAX_BATCHED_TOKENS} --max-num-seqs {MAX_NUM_SEQS}`
  (its defaults on this machine spelled out, and the thread executor, so that the step timer
  of the `--timed-serve` wrapper described under engine overhead sees every step);
- `transformers serve <that model directory> --continuous-batching --dtype bfloat16 --device cpu
  --cb-block-size {BLOCK_SIZE} --cb-num-blocks {NUM_KV_BLOCKS} --cb-max-batch-tokens
  {MAX_BATCHED_TOKENS}`: the same KV capacity (46,592 tokens) and tokens per step, offline
  (`HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1`); measured as **{tname}**;
{llama_bullet(bench)}- the ceiling: `harness.workload.torch_decode_loop` (batched decode with a `DynamicCache`) at batch =
  C, {bench.prompt_len}-token prompts, {bench.s.max_tokens} new tokens, in a fresh process; the
  faster of the model's default attention (SDPA) and eager attention. It is decode only (no
  prefill, no HTTP, no scheduling), but it is not an upper bound for stoic: transformers' SDPA
  path for grouped-query decode in bfloat16 is slow on CPU, and even eager attention re-reads a
  concatenated cache, while stoic decodes with its own paged attention (see the attention table).

TTFT: request sent to first content event. ITL: gaps between successive content events as the
client receives them (events that arrive in one read count as ~0). TPOT: (E2E - TTFT) / (tokens -
1) per request. Tokens: the server's `usage.completion_tokens`. Requests: completed / planned.

{results_table(bench.results)}

![output tokens/s and TTFT p50 against concurrency]({rel_png})

### Through the Python API

Servers stopped; each measurement in a fresh process (see the notes). Steady decode: 32
sequences, 128-token prompts, 128 new tokens, tokens/s once all 32 decode
(`harness.workload.stoic_steady`, stoic's `Engine` with the settings above), next to the bare torch
decode loop at batch 32 (`harness.workload.torch_decode_loop`, the faster attention). Concurrency 1:
the first {bench.s.api_requests} mixed requests one at a time, `max_tokens` {bench.s.max_tokens},
EOS ignored, next to transformers `generate` one request at a time
(`harness.workload.hf_one_at_a_time`); both include prefill.

{api_table(bench.api_rows, bench.api_other)}

The bare torch decode loop by attention implementation (each in a fresh process):

{chr(10).join(variants_table(bench))}

dtype check, the bare loop (faster attention; 128-token prompts, 32 new tokens):

{chr(10).join(dtype_lines)}

### Engine overhead at concurrency {top}

{profile_section(bench)}

### Notes

{notes}
- Every in-process torch measurement (ceiling, `generate`, stoic's `Engine`) runs in a fresh
  process with its torch work on one thread. torch's CPU build uses libgomp: each thread that
  calls torch gets its own OpenMP team, and once a process has more OpenMP threads than cores,
  libgomp stops spin-waiting between parallel regions. On this 2-core machine `generate` fell from
  42 to 27 tokens/s after a single call from a second thread, for the rest of the process
  (`OMP_WAIT_POLICY=PASSIVE`: 26 throughout). Both servers keep torch on one thread; anything that
  calls torch from a second thread of the server would pay this.
- On 2 cores, torch's two intra-op threads already fill the machine, so any other runnable thread
  (the event loop, the load generator, a profiler, another process) takes time from the forward
  pass: that is why the measurements are guarded by `other CPU`.
"""


SECTION_TITLE = "## Serving over HTTP, steady decode and engine overhead (`serving_bench.py`)"
BEGIN = "<!-- serving_bench.py: begin (generated; edits between these markers are overwritten) -->"
END = "<!-- serving_bench.py: end -->"


def write_doc(path: Path, section: str) -> None:
    """Put ``section`` between the markers in ``path``, leaving the rest of the file alone
    (without markers: before the first ``##`` section, or into a new file)."""
    block = f"{BEGIN}\n{section.strip()}\n{END}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    elif "\n## " in text:
        i = text.index("\n## ") + 1
        text = text[:i] + block + "\n" + text[i:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def print_summary(bench: Bench) -> None:
    print()
    print(results_table(bench.results))
    print()
    print(api_table(bench.api_rows, bench.api_other))
    print()
    for a, b, c, d in targets(bench):
        print(f"{a:70s} {b:>9s} {c:>8s}  {d}")
    if bench.profile:
        p = bench.profile
        print("\nexecutor:", {k: f"{v:.1%}" for k, v in p.executor.items()})
        print("event loop:", {k: f"{v:.1%}" for k, v in p.loop.items()})
