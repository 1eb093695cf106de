"""Every server setting is declared once, on ServerOptions (sidecar/grpc/options.py), and has exactly one
flag, one environment variable and one YAML key, all derived from its name.

``TABLE`` holds, for every setting, a value other than its default: as the flag and the environment
give it (text), as YAML gives it, and as the server then reads it. Each row is given three ways
and must arrive where the server reads it; a setting without a row, or a row without a setting,
fails the coverage test.
"""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest
import yaml

from engine.config import EngineConfig
from sidecar.grpc.auth import AuthSettings
from sidecar.cli.args import build_parser
from sidecar.turns.limits import TenantLimits
from sidecar.grpc.options import ServerOptions
from sidecar.turns.protocol import Limits
from sidecar.cli.serve_config import load_serve_settings
from sidecar.settings import SettingError, setting, settings_of

TOKENS_FILE = "{tokens}"
"""Stands for a token file written by the test (``--auth-file`` reads it while the options are built)."""

TABLE = {
    # name: (flag / env text, YAML value, the value the server reads)
    "host": ("0.0.0.0", "0.0.0.0", "0.0.0.0"),
    "port": ("6000", 6000, 6000),
    "max_message_bytes": ("1024", 1024, 1024),
    "tls_cert": ("/tls/cert.pem", "/tls/cert.pem", "/tls/cert.pem"),
    "tls_key": ("/tls/key.pem", "/tls/key.pem", "/tls/key.pem"),
    "tls_client_ca": ("/tls/ca.pem", "/tls/ca.pem", "/tls/ca.pem"),
    "max_messages": ("8", 8, 8),
    "max_tools": ("4", 4, 4),
    "max_stop": ("2", 2, 2),
    "max_turn_bytes": ("4096", 4096, 4096),
    "default_max_tokens": ("64", 64, 64),
    "max_sessions_per_tenant": ("5", 5, 5),
    "max_tokens_per_turn": ("100", 100, 100),
    "max_pinned_sessions_per_tenant": ("2", 2, 2),
    "tenant_limit": (
        "batch:max_sessions_per_tenant=9",
        ["batch:max_sessions_per_tenant=9"],
        {"batch": {"max_sessions_per_tenant": 9}},
    ),
    "auth_token": ("t0k=acme", ["t0k=acme"], {"t0k": "acme"}),
    "auth_file": (TOKENS_FILE, [TOKENS_FILE], {"f1le": "beta"}),
    "store": ("redis://redis:6379/0", "redis://redis:6379/0", "redis://redis:6379/0"),
    "snapshot_hmac_key_file": ("/run/hmac", "/run/hmac", "/run/hmac"),
    "allow_store_down": ("on", True, True),
    "store_check_s": ("0.5", 0.5, 0.5),
    "snapshot_kv": ("off", False, False),
    "snapshot_queue": ("8", 8, 8),
    "snapshot_retry_max_s": ("1.5", 1.5, 1.5),
    "durability": ("sync", "sync", "sync"),
    "session_idle_s": ("60", 60, 60.0),
    "session_ttl_s": ("7", 7, 7.0),
    "idempotency_window": ("4", 4, 4),
    "resume_wait_s": ("0.25", 0.25, 0.25),
    "grace_s": ("3", 3, 3.0),
    "flush_timeout_s": ("4", 4, 4.0),
    "http_port": ("8000", 8000, 8000),
    "http_host": ("0.0.0.0", "0.0.0.0", "0.0.0.0"),
    "served_model_name": ("my-model", "my-model", "my-model"),
    "metrics_port": ("9400", 9400, 9400),
    "metrics_host": ("0.0.0.0", "0.0.0.0", "0.0.0.0"),
    "log_level": ("DEBUG", "DEBUG", "DEBUG"),
    "log_format": ("json", "json", "json"),
}

SPECS = {spec.name: spec for spec in settings_of(ServerOptions)}


def read(options: ServerOptions, name: str):
    """Where the server reads setting ``name``."""
    spec = SPECS[name]
    holder = {
        ServerOptions: options,
        Limits: options.limits,
        TenantLimits: options.tenant_limits,
    }.get(spec.owner)
    if spec.owner is AuthSettings:
        return options.auth.tokens  # both auth settings end in the Authenticator's tokens
    return getattr(holder, spec.field)


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("f1le beta\n")
    return str(path)


def _text(value, tokens_file):
    if isinstance(value, list):
        return [_text(v, tokens_file) for v in value]
    return value.replace(TOKENS_FILE, tokens_file) if isinstance(value, str) else value


def test_the_table_covers_every_setting_and_each_has_one_spelling():
    assert set(TABLE) == set(SPECS)
    assert len(SPECS) == len(settings_of(ServerOptions))  # no two fields share a name
    for name, spec in SPECS.items():
        assert spec.flag == "--" + name.replace("_", "-") and spec.env == "CHAINKV_" + name.upper()
    # the YAML file holds the engine's fields beside these: no name may mean both
    assert not set(SPECS) & {f.name for f in dataclasses.fields(EngineConfig)}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_setting_arrives_from_its_flag_its_env_and_its_yaml_key(name, tokens_file, tmp_path):
    text, yaml_value, expected = TABLE[name]
    spec = SPECS[name]
    assert read(ServerOptions(), name) != expected, "the row must differ from the default"
    text, yaml_value = _text(text, tokens_file), _text(yaml_value, tokens_file)
    parser = build_parser()
    if spec.kind is bool:
        argv = [spec.flag if expected else "--no-" + spec.flag[2:]]
    else:
        argv = [spec.flag, text]
    _, from_flag = load_serve_settings(parser.parse_args(["serve", *argv]), environ={})
    _, from_env = load_serve_settings(parser.parse_args(["serve"]), environ={spec.env: text})
    config = tmp_path / "chainkv.yaml"
    config.write_text(yaml.safe_dump({name: yaml_value, "budget": 64}))
    engine, from_yaml = load_serve_settings(parser.parse_args(["serve", "--config", str(config)]), environ={})
    assert read(from_flag, name) == read(from_env, name) == read(from_yaml, name) == expected
    assert engine.budget == 64  # the engine's keys of the same file go to the EngineConfig


def test_the_defaults_are_the_fields_and_nowhere_else(capsys):
    """A flag carries no default of its own (it is set only when given); what serve gets with nothing
    given is ServerOptions(), and ``serve --help`` shows the field's default."""
    args = build_parser().parse_args(["serve"])
    assert not [name for name in SPECS if hasattr(args, name)]
    _, options = load_serve_settings(args, environ={})
    for name in SPECS:
        assert read(options, name) == read(ServerOptions(), name), name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    entries = [" ".join(e.split("\n\n")[0].split()) for e in re.split(r"\n  (?=--)", capsys.readouterr().out)]
    entries = {e.split()[0].rstrip(","): e for e in entries}  # flag -> its whole help entry
    for spec in SPECS.values():
        if spec.default not in (None, [], {}):
            assert entries[spec.flag].endswith(f"(default: {spec.default})"), entries[spec.flag]


def test_the_command_line_wins_over_the_environment_which_wins_over_the_yaml(tmp_path):
    config = tmp_path / "chainkv.yaml"
    config.write_text("port: 7000\ngrace_s: 9\nlog_level: ERROR\n")
    args = build_parser().parse_args(["serve", "--config", str(config), "--port", "50051"])
    _, o = load_serve_settings(args, environ={"CHAINKV_PORT": "6000", "CHAINKV_GRACE_S": "8"})
    # a flag given at its default value still wins (it was given)
    assert (o.port, o.grace_s, o.log_level) == (50051, 8.0, "ERROR")


@pytest.mark.parametrize(
    "env, words",
    [
        ({"CHAINKV_PORT": "tcp://10.0.0.1:50051"}, ["CHAINKV_PORT", "tcp://10.0.0.1:50051"]),
        ({"CHAINKV_DURABILITY": "eventually"}, ["CHAINKV_DURABILITY", "async, sync"]),
        ({"CHAINKV_SNAPSHOT_KV": "maybe"}, ["CHAINKV_SNAPSHOT_KV", "true or false"]),
    ],
)
def test_a_bad_value_names_where_it_came_from(env, words):
    with pytest.raises(SettingError) as e:
        load_serve_settings(build_parser().parse_args(["serve"]), environ=env)
    assert all(w in str(e.value) for w in words)


def test_a_field_that_is_not_declared_as_a_setting_is_refused():
    @dataclasses.dataclass
    class Options:
        port: int = setting(1, "a port")
        undeclared: int = 2

    with pytest.raises(TypeError, match="Options.undeclared"):
        settings_of(Options)


def test_tensor_parallel_rank0_gets_the_setup_as_read(tmp_path):
    """rank 0 is another process (spawn): what it gets is the parent's ServeSetup, pickled, with the
    tokens already read (it does not read flags, env, YAML or token files again)."""
    from sidecar.cli.serve import ServeSetup

    tokens = tmp_path / "tokens"
    tokens.write_text("f1le beta\n")
    args = build_parser().parse_args(["serve", "--auth-file", str(tokens), "--default-max-tokens", "64"])
    config, options = load_serve_settings(args, environ={"CHAINKV_STORE": "none"})
    setup = ServeSetup(config, options, None)
    tokens.unlink()
    copy = pickle.loads(pickle.dumps(setup))
    assert copy.config == config and copy.options.limits.default_max_tokens == 64
    assert copy.options.auth.tokens == {"f1le": "beta"} and copy.options.store == "none"
    assert copy.open_store() is None
