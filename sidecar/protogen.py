"""Generate the Python gRPC stubs in sidecar/_proto from proto/chainkv/v1/sidecar.proto.

    python -m sidecar.protogen            # regenerate the checked-in stubs
    python -m sidecar.protogen OUT_DIR    # generate into another folder (the stub test diffs the two)

grpcio-tools writes ``from chainkv.v1 import sidecar_pb2`` into the service stub, an import that
only works with the generated folder on ``sys.path``; the stubs are rewritten to import their
sibling relatively so they work as the package ``sidecar._proto.chainkv.v1``. The stubs depend on
the grpcio-tools version (pinned in pyproject's test extra).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTOS = ["chainkv/v1/sidecar.proto"]
STUB_DIR = ROOT / "sidecar" / "_proto"
PACKAGE_DOC = '"""Generated gRPC stubs (python -m sidecar.protogen); do not edit."""\n'


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs (and the package __init__ files) under ``out_dir``; returns the files."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(PROTO_ROOT / p) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOS}")
    files = []
    for proto in PROTOS:
        pkg = out_dir / Path(proto).parent
        stem = Path(proto).stem
        for part in [
            out_dir,
            *[out_dir / Path(*Path(proto).parent.parts[: i + 1]) for i in range(len(Path(proto).parent.parts))],
        ]:
            init = part / "__init__.py"
            init.write_text(PACKAGE_DOC)
            files.append(init)
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = pkg / f"{stem}{suffix}"
            text = path.read_text()
            # "from chainkv.v1 import sidecar_pb2 as ..." -> "from . import sidecar_pb2 as ..."
            module = ".".join(Path(proto).parent.parts)
            text = re.sub(rf"^from {re.escape(module)} import ", "from . import ", text, flags=re.M)
            path.write_text(text)
            files.append(path)
    return sorted(set(files))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else STUB_DIR
    for f in generate(target):
        print(f)
