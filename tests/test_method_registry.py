"""The method registry and the shared parts of every method (no model loaded)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch

import engine.methods
from engine.config import EngineConfig
from engine.lifecycle import ModelShape, SparseMethod
from engine.method_spec import MethodError, MethodSpec
from engine.methods import REGISTRY, create_method, register

SHAPE = ModelShape(
    num_layers=24,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    page_size=4,
    rope_cos=torch.ones(64, 32),
    rope_sin=torch.zeros(64, 32),
    device=torch.device("cpu"),
)


def test_every_method_module_registers_its_method():
    defined = set()
    for mod in pkgutil.iter_modules(engine.methods.__path__):
        module = importlib.import_module(f"engine.methods.{mod.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, SparseMethod) and cls.__module__ == module.__name__ and cls.name:
                defined.add(cls.name)
    assert defined == set(REGISTRY)
    assert all(REGISTRY[name].name == name for name in REGISTRY)


def test_a_taken_name_is_refused():
    class Impostor(SparseMethod):
        name = "snapkv"

    with pytest.raises(ValueError, match="already registered"):
        register(Impostor)
    assert REGISTRY["snapkv"] is not Impostor


def test_method_spec_and_engine_config_name_the_method_alike():
    """MethodSpec is the per-request form of EngineConfig's method fields: same names, same defaults."""

    def default(f):
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    config_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(MethodSpec):
        assert f.name in config_fields and default(f) == default(config_fields[f.name]), f.name
    cfg = EngineConfig(method="snapkv", budget=32, method_args={"window_size": 8})
    assert MethodSpec.from_config(cfg) == MethodSpec("snapkv", 32, None, {"window_size": 8})


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_kept_tokens_is_the_budget_plus_slack_for_methods_that_hold_it(name):
    cls = REGISTRY[name]
    spec = MethodSpec(name, budget=64) if cls.needs_budget else MethodSpec(name)
    try:
        method = create_method(spec, SHAPE)
    except MethodError as e:  # a method whose defaults need more than a bare shape (a pattern file)
        pytest.skip(str(e))
    kept = method.kept_tokens(1000)
    if cls.holds_budget:
        assert kept == 64 + method.kept_slack() and method.kept_tokens(10) == 10
    else:
        assert kept == 1000
