"""What a new user meets on the command line (issue 18): one clear line and exit 2, before any model
loads, for a malformed or missing config file, a port already in use and an empty prompt; and one
session's rendering never waits on another's (each rendering thread has its own tokenizer)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def chainkv(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        CHAINKV_CACHE=os.environ.get("CHAINKV_CACHE", str(Path.home() / ".cache/chainkv")),
    )
    return subprocess.run(
        [sys.executable, "-m", "sidecar.cli", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("chainkv: ") and all(w in err for w in words), err


@pytest.mark.slow
@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
@pytest.mark.parametrize("content", ["a: [1\n", "\tbad: tab\n"])
def test_a_malformed_config_is_one_line(tmp_path, command, content):
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    one_line_error(chainkv(*command, "--config", str(f)), "bad.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_a_missing_config_is_one_line(tmp_path, command):
    one_line_error(chainkv(*command, "--config", str(tmp_path / "nope.yaml")), "nope.yaml")


@pytest.mark.slow
def test_a_port_in_use_is_one_line_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = chainkv("serve", "--port", str(port), "--store", "none")
    one_line_error(r, f"127.0.0.1:{port}")
    assert "serving" not in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args", [["generate", ""], ["generate", "--chat", ""], ["generate", "  \n"]])
def test_an_empty_prompt_is_refused_at_once(args):
    one_line_error(chainkv(*args), "empty")


@pytest.mark.slow
def test_an_empty_prompt_on_stdin_is_refused(tmp_path):
    one_line_error(chainkv("generate", "-", stdin=""), "empty")


def test_each_rendering_thread_has_its_own_tokenizer(smollm2_dir):
    from engine.model.loader import load_tokenizer
    from sidecar.turns.chat import ChatRenderer

    tok = load_tokenizer(Path(smollm2_dir))
    renderer = ChatRenderer(tok, {tok.eos_token_id})
    big = [{"role": "user", "content": "word " * 20000}]
    small = [{"role": "user", "content": "Hello there."}]
    alone = renderer.first_turn(small).token_ids
    seen, results = {}, {}

    def render(name, messages):
        seen[name] = renderer._tok()
        results[name] = renderer.first_turn(messages).token_ids

    threads = [
        threading.Thread(target=render, args=("big", big)),
        threading.Thread(target=render, args=("small", small)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["big"] is not seen["small"] and seen["small"] is not tok
    assert results["small"] == alone and len(results["big"]) > 20000
