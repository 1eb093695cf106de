"""Render a kustomization without kubectl: the subset of kustomize that deploy/k8s uses.

    python deploy/render.py deploy/k8s/overlays/gpu > gpu.yaml

Supported: ``resources`` (YAML files, or folders with a kustomization.yaml), ``patches`` given by
``path`` (strategic-merge patches, matched to a resource by apiVersion group, kind and name) and
``images`` (``newName`` / ``newTag``). Strategic merge follows Kubernetes' merge keys for the lists
these manifests patch (containers, initContainers, volumes, env by ``name``; volumeMounts by
``mountPath``; ports by ``containerPort``); other lists are replaced. Anything else in a
kustomization is refused, so a manifest change that needs real kustomize fails loudly here.
The tests check that this renders what ``kubectl kustomize`` renders where kubectl exists.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

KNOWN = {"apiVersion", "kind", "resources", "patches", "images"}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


class RenderError(ValueError):
    pass


def _load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def merge(base, patch, key: str | None = None):
    """Strategic merge of ``patch`` into ``base`` (new objects; inputs unchanged)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        mk = MERGE_KEYS[key]
        out = [copy.deepcopy(x) for x in base]
        new = []
        for item in patch:
            at = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(mk) == item.get(mk)), None)
            if at is None:
                new.append(copy.deepcopy(item))
            else:
                out[at] = merge(out[at], item, None)
        return new + out  # as kustomize does: items only in the patch come first
    return copy.deepcopy(patch)


def _set_images(obj, images: list[dict]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                for c in v:
                    name, _, tag = c.get("image", "").partition(":")
                    for img in images:
                        if img["name"] == name:
                            c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag or 'latest')}"
            else:
                _set_images(v, images)
    elif isinstance(obj, list):
        for v in obj:
            _set_images(v, images)


def render(folder: str | Path) -> list[dict]:
    folder = Path(folder)
    kfile = folder / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{folder} has no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - KNOWN
    if unknown:
        raise RenderError(f"{kfile}: this renderer does not support {sorted(unknown)}; use kubectl kustomize")
    docs: list[dict] = []
    for res in k.get("resources", []):
        p = folder / res
        docs += render(p) if p.is_dir() else _load_docs(p)
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise RenderError(f"{kfile}: only patches given by path are supported, not {patch}")
        for p in _load_docs(folder / patch["path"]):
            target = (_group(p["apiVersion"]), p["kind"], p["metadata"]["name"])
            hits = [
                i for i, d in enumerate(docs) if (_group(d["apiVersion"]), d["kind"], d["metadata"]["name"]) == target
            ]
            if len(hits) != 1:
                raise RenderError(f"{kfile}: patch {patch['path']} matches {len(hits)} resources")
            docs[hits[0]] = merge(docs[hits[0]], p)
    if k.get("images"):
        for d in docs:
            _set_images(d, k["images"])
    return docs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python deploy/render.py KUSTOMIZATION_FOLDER", file=sys.stderr)
        return 2
    try:
        docs = render(args[0])
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"render: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
