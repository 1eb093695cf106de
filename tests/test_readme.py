"""The README as a new user follows it: its test command is the one CI runs; every ``chainkv`` command
in its bash blocks parses (argparse, then the engine settings: nothing is started, no model is loaded,
so files, ports and stores they name are not checked); and every Python block runs as pasted, the
server ones against a real ``chainkv serve`` with both fronts, which is what the README's first
command starts (only the addresses are swapped for the test server's free ports)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
GRPC, HTTP = "127.0.0.1:50051", "127.0.0.1:8000"
"""Where the README's first command serves gRPC and the OpenAI-compatible HTTP API."""


@dataclass(frozen=True)
class Block:
    """A fenced code block of the README."""

    language: str
    line: int
    """The README line of the block's first line of code."""
    code: str


def readme_blocks(language: str) -> list[Block]:
    fences = re.finditer(r"^```(\w*)\n(.*?)^```$", README, re.M | re.S)
    return [
        Block(m.group(1), README.count("\n", 0, m.start()) + 2, m.group(2)) for m in fences if m.group(1) == language
    ]


def chainkv_commands() -> list[tuple[int, list[str]]]:
    """(README line, arguments) of every ``chainkv ...`` command in a bash block, alone or in an ``&&`` chain."""
    commands = []
    for block in readme_blocks("bash"):
        for offset, line in enumerate(block.code.splitlines()):
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["chainkv"]:
                    commands.append((block.line + offset, words[1:]))
    return commands


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in ci
    assert ci in README, "the README's test command and .ci/run have drifted apart"


@pytest.mark.parametrize(
    "argv", [argv for _, argv in chainkv_commands()], ids=[f"line{n}" for n, _ in chainkv_commands()]
)
def test_every_chainkv_command_in_the_readme_parses(argv, capsys):
    from sidecar.cli.args import build_parser
    from sidecar.cli.engine_args import engine_config_from_args

    parser = build_parser()
    if "--help" in argv:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 0 and "usage: chainkv" in capsys.readouterr().out
        return
    args = parser.parse_args(argv)  # a flag that does not parse exits 2
    if args.command in ("serve", "generate", "calibrate"):
        engine_config_from_args(args)  # ConfigError for a bad engine setting


def test_the_snippets_talk_to_the_server_the_readme_starts():
    """The first command starts one server with both fronts; every address a Python block uses is one of them."""
    from sidecar.cli.args import build_parser
    from sidecar.cli.serve_config import load_serve_settings

    first = next(argv for _, argv in chainkv_commands() if argv[:1] == ["serve"])
    _, o = load_serve_settings(build_parser().parse_args(first), environ={})
    assert f"{o.host}:{o.port}" == GRPC and f"{o.http_host or o.host}:{o.http_port}" == HTTP
    blocks = readme_blocks("python")
    used = {a for b in blocks for a in re.findall(r"\b\d+\.\d+\.\d+\.\d+:\d+", b.code)}
    assert used == {GRPC, HTTP}


@pytest.mark.slow
@pytest.mark.parametrize("block", readme_blocks("python"), ids=lambda b: f"line{b.line}")
def test_every_python_block_in_the_readme_runs(block, request):
    code = block.code
    if GRPC in code or HTTP in code:
        sidecar = request.getfixturevalue("smollm2_sidecar")
        code = code.replace(GRPC, f"127.0.0.1:{sidecar.port}").replace(HTTP, f"127.0.0.1:{sidecar.http_port}")
    exec(compile(code, f"README.md, the block at line {block.line}", "exec"), {"__name__": "__readme__"})
