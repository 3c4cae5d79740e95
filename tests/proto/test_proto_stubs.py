"""The committed gRPC stubs are exactly what `make proto` (regenerate_stubs) produces today."""
from pathlib import Path

from proto.diffusion_gr2 import PROTO_FILES, PROTO_ROOT, regenerate_stubs, stub_paths


def test_committed_stubs_are_fresh(tmp_path):
    written = regenerate_stubs(tmp_path)
    assert len(written) == 3 * len(PROTO_FILES)
    for proto_file in PROTO_FILES:
        for rel in stub_paths(proto_file):
            committed = PROTO_ROOT / rel
            assert committed.exists(), f"{rel} is missing: run `make proto`"
            assert committed.read_text() == (tmp_path / rel).read_text(), \
                f"{rel} is stale (the .proto or grpcio-tools changed): run `make proto` and commit the result"


def test_stubs_import_as_part_of_the_package():
    from proto.diffusion_gr2.v1 import reranker_pb2, reranker_pb2_grpc

    text = Path(reranker_pb2_grpc.__file__).read_text()
    assert "from . import reranker_pb2" in text and "from diffusion_gr2" not in text
    assert reranker_pb2.DESCRIPTOR.package == "diffusion_gr2.v1"
    service = reranker_pb2.DESCRIPTOR.services_by_name["Reranker"]
    assert set(service.methods_by_name) == {"Rerank", "Recommend"}
    assert hasattr(reranker_pb2_grpc, "RerankerStub") and hasattr(reranker_pb2_grpc, "add_RerankerServicer_to_server")
