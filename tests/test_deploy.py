"""deploy/: the kustomize overlays render (kubectl kustomize where it exists, deploy/render.py always; the
two agree), every rendered object passes ``kubernetes-validate --strict`` against Kubernetes 1.33
offline, and what they configure is what chainkv reads (the ConfigMap's settings, the Secret's
token file and HMAC key)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu-dev", "gpu"]
K8S_VERSION = "1.33.0"


def render_python(overlay: str) -> list[dict]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("deploy_render", ROOT / "deploy" / "render.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.render(K8S / "overlays" / overlay)


def render_kubectl(overlay: str) -> list[dict] | None:
    if shutil.which("kubectl") is None:
        return None
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_id(docs: list[dict]) -> dict:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    overlay = request.param
    ours = render_python(overlay)
    theirs = render_kubectl(overlay)
    if theirs is not None:
        assert by_id(ours) == by_id(theirs), f"deploy/render.py and kubectl kustomize disagree on {overlay}"
    return overlay, by_id(theirs if theirs is not None else ours)


def test_rendered_manifests_pass_strict_validation(rendered):
    import kubernetes_validate

    overlay, objs = rendered
    assert set(objs) == {
        ("ConfigMap", "chainkv-config"),
        ("Secret", "chainkv-secrets"),
        ("Deployment", "agent"),
        ("Service", "chainkv-redis"),
        ("StatefulSet", "chainkv-redis"),
    }
    for (kind, name), obj in objs.items():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError


def test_validation_rejects_a_broken_manifest(rendered):
    import kubernetes_validate

    _, objs = rendered
    bad = yaml.safe_load(yaml.safe_dump(objs[("Deployment", "agent")]))
    bad["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_native_sidecar_probes_resources_and_security(rendered):
    overlay, objs = rendered
    pod = objs[("Deployment", "agent")]["spec"]["template"]["spec"]
    (sidecar,) = [c for c in pod["initContainers"] if c["name"] == "chainkv"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert sidecar["image"] == "ghcr.io/chainkv/chainkv:0.1.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["grpc"] == {"port": 50051, "service": "chainkv.v1.Sidecar"}
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert pod["enableServiceLinks"] is False  # no CHAINKV_PORT=tcp://... from a Service named chainkv
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] and sidecar["securityContext"]["capabilities"][
        "drop"
    ] == ["ALL"]
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert env["CHAINKV_SNAPSHOT_HMAC_KEY_FILE"].startswith("/etc/chainkv/secrets/")
    limits = sidecar["resources"]["limits"]
    if overlay == "gpu":
        assert limits["nvidia.com/gpu"] == "1" and sidecar["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    else:
        assert "nvidia.com/gpu" not in limits
    redis = objs[("StatefulSet", "chainkv-redis")]["spec"]["template"]["spec"]["containers"][0]
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes"


def test_configured_settings_are_what_chainkv_reads(rendered, tmp_path):
    """The ConfigMap's chainkv.yaml goes through the same loader as ``chainkv serve --config``
    (unknown keys fail), with the env the Deployment sets pointing at the Secret's files."""
    from sidecar.auth import Authenticator
    from sidecar.cli import build_parser
    from sidecar.engine_args import engine_config_from_args
    from sidecar.integrity import SnapshotKeys
    from sidecar.limits import TenantLimits
    from sidecar.serve_config import apply_settings

    overlay, objs = rendered
    config = tmp_path / "chainkv.yaml"
    config.write_text(objs[("ConfigMap", "chainkv-config")]["data"]["chainkv.yaml"])
    secret = objs[("Secret", "chainkv-secrets")]["stringData"]
    for key, value in secret.items():
        (tmp_path / key).write_text(value)
    pod = objs[("Deployment", "agent")]["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    assert sidecar["args"] == ["serve", "--config", "/etc/chainkv/chainkv.yaml"]
    env = {
        e["name"]: e["value"].replace("/etc/chainkv/secrets", str(tmp_path))
        for e in sidecar["env"]
        if e["name"].startswith("CHAINKV_")
    }
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(config)])
    apply_settings(args, parser, env)
    engine = engine_config_from_args(args)
    assert args.host == "0.0.0.0" and args.port == 50051 and args.metrics_port == 9400 and args.log_format == "json"
    assert args.store.startswith("redis://chainkv-redis:6379")
    assert engine.device == ("cuda" if overlay == "gpu" else "cpu")
    TenantLimits(args.max_sessions_per_tenant, args.max_tokens_per_turn)
    auth = Authenticator.from_args(args.auth_token, args.auth_file)
    assert auth.tenant([("authorization", f"Bearer {secret['agent-token']}")]) == "agent"
    assert SnapshotKeys.from_file(args.snapshot_hmac_key_file).keys
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}


def test_dockerfile_runs_as_a_non_root_user_on_a_cuda_base():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "ARG CUDA_IMAGE=nvidia/cuda:" in text and "FROM ${CUDA_IMAGE}" in text
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
