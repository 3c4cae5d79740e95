"""Generated gRPC stubs for the `diffusion_gr2.*` proto packages, and the function that makes them.

protoc names imports after the proto package (`from diffusion_gr2.v1 import reranker_pb2`), which
would only resolve with proto/ itself on sys.path. The project imports the stubs as
`proto.diffusion_gr2.v1`, so `regenerate_stubs` rewrites that one import to a relative one. `make
proto` and the staleness test both call it, so the committed stubs are exactly its output.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent  # the proto/ directory (protoc's -I)
PROTO_FILES = ("diffusion_gr2/v1/reranker.proto",)
# protoc writes these next to each .proto (relative to PROTO_ROOT)
_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
_ABSOLUTE_IMPORT = re.compile(r"^from diffusion_gr2(?:\.\w+)* import (\w+_pb2) as ", re.M)


def stub_paths(proto_file: str) -> list[str]:
    stem = proto_file[: -len(".proto")]
    return [stem + suffix for suffix in _SUFFIXES]


def regenerate_stubs(out_root: str | Path | None = None) -> list[Path]:
    """Run protoc on PROTO_FILES and write the stubs under `out_root` (default: proto/ itself).

    Returns the written files. Raises RuntimeError with protoc's exit code when it fails.
    """
    from grpc_tools import protoc  # build-time dependency only

    out_root = Path(out_root) if out_root is not None else PROTO_ROOT
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for proto_file in PROTO_FILES:
            # argv[0] is ignored by protoc; the well-known types ship inside grpc_tools.
            well_known = Path(protoc.__file__).parent / "_proto"
            rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={tmp}",
                              f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", str(PROTO_ROOT / proto_file)])
            if rc != 0:
                raise RuntimeError(f"protoc failed on {proto_file} (exit code {rc})")
            for rel in stub_paths(proto_file):
                text = (Path(tmp) / rel).read_text(encoding="utf-8")
                # same-package stubs import each other relatively (see the module docstring)
                text = _ABSOLUTE_IMPORT.sub(r"from . import \1 as ", text)
                dest = out_root / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(text, encoding="utf-8")
                written.append(dest)
    return written
