"""``stoic serve`` argument parsing."""

from __future__ import annotations

import argparse

import pytest

import stoic
from stoic.cli import build_parser, config_from_args
from stoic.config import FaultSpec


def test_cli_arguments_map_to_config() -> None:
    """`stoic serve` options become the EngineConfig fields."""
    args = build_parser().parse_args(
        [
            "serve",
            "--model", "/models/x.gguf",
            "--served-model-name", "x",
            "--num-kv-blocks", "64",
            "--max-num-seqs", "8",
            "--max-restarts", "2",
            "--restart-window", "10",
            "--step-timeout", "5",
            "--enable-fault-injection",
            "--fault", '{"kind": "error", "after_steps": 2}',
            "--fault", '{"kind": "oom", "probability": 0.5, "seed": 1}',
            "--drain-timeout", "3",
            "--executor", "process",
            "--executor-spares", "1",
            "--recovery", "resume",
            "--max-resumes", "5",
            "--fault", '{"kind": "error", "match": "XYZZY"}',
            "--quantization", "none",
            "--weight-layouts", "compact",
            "--threads", "3",
            "--no-adapt-threads",
            "--deterministic",
            "--kv-cache-dtype", "float32",
            "--no-kv-outlives-worker",
            "--speculative", "ngram",
            "--num-speculative-tokens", "6",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.executor, config.executor_spares) == ("process", 1)
    assert config.model == "/models/x.gguf" and config.served_model_name == "x"
    assert config.num_kv_blocks == 64 and config.max_num_seqs == 8
    assert (config.max_restarts, config.restart_window, config.step_timeout) == (2, 10.0, 5.0)
    assert config.enable_fault_injection and config.drain_timeout == 3.0
    assert (config.recovery, config.max_resumes) == ("resume", 5)
    assert config.quantization == "none" and config.deterministic
    assert config.weight_layouts == "compact"
    assert config.kv_cache_dtype == "float32" and config.kv_outlives_worker is False
    assert (config.threads, config.adapt_threads) == (3, False)
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 6)
    assert config.faults == (
        FaultSpec(kind="error", after_steps=2),
        FaultSpec(kind="oom", probability=0.5, seed=1),
        FaultSpec(kind="error", match="XYZZY"),
    )
    # `stoic serve` runs the model in a worker process by default; the library in a thread
    default = config_from_args(build_parser().parse_args(["serve"]))
    assert default == stoic.EngineConfig(executor="process")


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--fault", '{"kind": "meteor", "after_steps": 1}'],
        ["serve", "--fault", "not json"],
        ["serve", "--num-kv-blocks", "8", "--kv-cache-memory", "1"],
        ["serve", "--port", "70000"],
        ["serve", "--max-num-seqs", "0"],
        ["serve", "--recovery", "retry"],
        ["serve", "--max-resumes", "-1"],
        ["serve", "--quantization", "int3"],
        ["serve", "--weight-layouts", "tiny"],
        ["serve", "--kv-cache-dtype", "int8"],
        ["serve", "--threads", "0"],
        ["serve", "--fault", '{"kind": "error", "match": ""}'],
        ["serve", "--fault", '{"kind": "error", "match": "x", "after_steps": 1}'],
        ["serve", "--max-queue-wait", "-1"],
        ["serve", "--tenant-weight", "acme"],
        ["serve", "--tenant-weight", "acme=0"],
        ["serve", "--tenant-weight", "=2"],
        ["serve", "--tenant-max-running", "0"],
        ["serve", "--tenant-max-queued", "0"],
        ["serve", "--speculative", "always"],
        ["serve", "--num-speculative-tokens", "0"],
    ],
)
def test_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Bad options are a usage error (exit status 2) with a message."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err


def test_faults_at_start_need_the_switch(capsys: pytest.CaptureFixture[str]) -> None:
    """--fault without --enable-fault-injection is a usage error; the config refuses it too."""
    from stoic.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--fault", '{"kind": "oom", "after_steps": 1}'])
    assert exited.value.code == 2
    assert "--enable-fault-injection" in capsys.readouterr().err
    with pytest.raises(ValueError, match="enable_fault_injection"):
        stoic.EngineConfig(faults=(FaultSpec(kind="oom", after_steps=1),))


@pytest.mark.parametrize("kind", ["crash", "segfault", "abort"])
def test_process_ending_faults_need_the_process_executor(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fault that ends the model's process is a usage error with --executor thread (it would
    kill the server) and accepted with --executor process."""
    from stoic.cli import main

    fault = f'{{"kind": "{kind}", "after_steps": 1}}'
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--executor", "thread", "--enable-fault-injection", "--fault", fault])
    assert exited.value.code == 2
    assert "needs the process executor" in capsys.readouterr().err
    args = build_parser().parse_args(
        ["serve", "--executor", "process", "--enable-fault-injection", "--fault", fault]
    )
    assert config_from_args(args).faults[0].kind == kind


def test_step_budget_below_the_sequence_limit_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A step budget smaller than --max-num-seqs would starve decodes: rejected before start."""
    from stoic.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"])
    assert exited.value.code == 2
    assert (
        "max_num_batched_tokens (32) must be at least max_num_seqs (64)" in capsys.readouterr().err
    )


def test_step_budget_default_depends_on_the_device() -> None:
    """No explicit budget: 256 tokens per step on a CPU, 2048 on a GPU, never below max_num_seqs."""
    assert stoic.EngineConfig().step_token_budget("cpu") == 256
    assert stoic.EngineConfig().step_token_budget("cuda") == 2048
    assert stoic.EngineConfig(max_num_seqs=300).step_token_budget("cpu") == 300
    assert stoic.EngineConfig(max_num_batched_tokens=100).step_token_budget("cuda") == 100


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`stoic --version` prints ``stoic <version>`` (the distribution's) and exits 0."""
    import importlib.metadata

    from stoic.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"stoic {importlib.metadata.version('stoic')}\n"


def test_python_m_stoic_version_exits_0() -> None:
    """The same through the module entry point, in a fresh interpreter."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "stoic", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("stoic ") and done.stderr == ""


def test_the_arguments_are_checked_before_torch_is_imported() -> None:
    """``stoic serve`` parses and checks its arguments without importing torch: the worker's
    interpreter (stoic._prestart) starts right after, and imports torch alongside the server
    instead of after it."""
    import subprocess
    import sys

    code = (
        "import sys; from stoic.cli import build_parser, config_from_args; "
        "args = build_parser().parse_args(['serve', '--model', 'x.gguf']); "
        "config_from_args(args); print(sorted(m for m in ('torch', 'transformers') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser


def test_every_serve_option_says_its_default() -> None:
    """`stoic serve --help` gives each option's default: its value, or what "unset" means (never
    "None")."""
    parser = _serve_parser()
    text = parser.format_help()
    assert "None" not in text
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        help_text = action.help or ""
        assert "default" in help_text, action.option_strings
        if action.default is None:  # "auto": the help must say what that means
            assert "%(default)" not in help_text, action.option_strings
        elif action.default not in (False, []) and not isinstance(action.default, bool):
            shown = help_text % {"default": action.default}
            assert str(action.default) in shown, action.option_strings


def test_serve_help_groups_every_option_by_job() -> None:
    """`stoic serve --help` shows six titled groups, in this order, and every option sits in
    exactly one of them (only -h in argparse's own "options")."""
    parser = _serve_parser()
    groups = {g.title: g for g in parser._action_groups if g._group_actions}
    assert list(groups) == [
        "options",
        "model",
        "engine",
        "overload and tenants",
        "server",
        "recovery",
        "scale-out",
    ]
    assert [a.dest for a in groups["options"]._group_actions] == ["help"]
    grouped = [a for title in list(groups)[1:] for a in groups[title]._group_actions]
    assert len(grouped) == len({id(a) for a in grouped}) == len(parser._actions) - 1
    assert "--model" in {o for a in groups["model"]._group_actions for o in a.option_strings}
    assert "--replicas" in {o for a in groups["scale-out"]._group_actions for o in a.option_strings}
    overload = {o for a in groups["overload and tenants"]._group_actions for o in a.option_strings}
    assert {"--max-queue-wait", "--tenant-header", "--tenant-weight"} <= overload
    text = parser.format_help()
    assert all(f"\n{title}:\n" in text for title in list(groups)[1:])


@pytest.mark.parametrize(
    "extra",
    [
        ["--api-key", "sk-a", "--admin-key", "sk-a"],
        ["--api-key", ""],
        ["--api-key-file", "/nonexistent/keys"],
        ["--max-connections", "0"],
        ["--header-timeout", "-1"],
    ],
)
def test_bad_access_and_limit_options_are_usage_errors(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A reused admin key, an empty key, an unreadable key file or a non-positive limit exits
    with status 2 and a message before anything starts."""
    from stoic.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", *extra])
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err


def test_access_and_limit_options_map_to_the_server() -> None:
    """--api-key (repeatable) and key files add up; the admin key and limits pass through;
    STOIC_API_KEY is used only when no --api-key is given."""
    import os
    from unittest import mock

    from stoic.cli import http_options

    argv = ["serve", "--api-key", "sk-1", "--api-key", "sk-2", "--admin-key", "adm"]
    argv += ["--metrics-require-key", "--max-request-bytes", "1000", "--max-connections", "7"]
    with mock.patch.dict(os.environ, {"STOIC_API_KEY": "sk-env"}):
        access, limits = http_options(build_parser().parse_args(argv))
        env_only, _ = http_options(build_parser().parse_args(["serve"]))
    assert access.api_keys == ("sk-1", "sk-2") and access.admin_key == "adm"
    assert access.metrics_require_key
    assert (limits.max_request_bytes, limits.max_connections) == (1000, 7)
    assert env_only.api_keys == ("sk-env",) and env_only.admin_key is None


def test_overload_options_map_to_the_config_and_the_server() -> None:
    """--max-queue-wait (0: no limit), --tenant-weight (repeatable, NAME=W, the last = splits),
    the tenant limits and --tenant-header reach the engine's config and the access policy."""
    from stoic.cli import http_options

    argv = ["serve", "--max-queue-wait", "2.5", "--tenant-weight", "acme=3"]
    argv += ["--tenant-weight", "a=b=0.5", "--tenant-max-running", "4", "--tenant-max-queued", "9"]
    argv += ["--tenant-header", "x-tenant-id", "--decode-stretch", "2.5"]
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    assert config.max_queue_wait == 2.5
    assert config.tenant_weights == {"acme": 3.0, "a=b": 0.5}
    assert (config.tenant_max_running, config.tenant_max_queued) == (4, 9)
    assert config.decode_stretch == 2.5
    assert http_options(args)[0].tenant_header == "x-tenant-id"
    unlimited = config_from_args(build_parser().parse_args(["serve", "--max-queue-wait", "0"]))
    assert unlimited.max_queue_wait is None and unlimited.decode_stretch is None
    assert stoic.EngineConfig().max_queue_wait == 30.0


def test_kv_outlives_worker_defaults_to_wherever_possible_and_refuses_where_it_cannot(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not given, the engine decides (on with the process executor on a host); asked for with
    the thread executor or on a GPU it is a usage error naming why."""
    from stoic.cli import main

    default = config_from_args(build_parser().parse_args(["serve"]))
    assert default.kv_outlives_worker is None
    on = config_from_args(build_parser().parse_args(["serve", "--kv-outlives-worker"]))
    assert on.kv_outlives_worker is True
    for argv, why in (
        (["--executor", "thread"], "needs the process executor"),
        (["--device", "cuda"], "host memory only"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--kv-outlives-worker", *argv])
        assert exited.value.code == 2
        assert why in capsys.readouterr().err
