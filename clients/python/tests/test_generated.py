"""The committed generated modules match the protos (drift check) and expose
every RPC of the service."""

from __future__ import annotations

import filecmp
import importlib.util
from pathlib import Path

import grpc
from _support import CLIENT_ROOT, REPO_ROOT

import delegation_broker
from delegation_broker import pb

PROTO_ROOT = REPO_ROOT / "proto"
COMMITTED = CLIENT_ROOT / "src" / "delegation_broker"


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("regenerate", CLIENT_ROOT / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated_files(package: Path) -> set[str]:
    files = {p.relative_to(package).as_posix() for p in (package / "_gen").rglob("*") if p.is_file()}
    files = {f for f in files if "__pycache__" not in f}
    return files | {"pb.py"}


def test_committed_generated_code_matches_the_protos(tmp_path):
    regenerate = _regenerate_module()
    fresh = tmp_path / "delegation_broker"
    regenerate.generate(PROTO_ROOT, fresh)
    committed, regenerated = _generated_files(COMMITTED), _generated_files(fresh)
    assert committed == regenerated, "generated file set drifted: run clients/python/regenerate.sh"
    drifted = [f for f in sorted(committed) if not filecmp.cmp(COMMITTED / f, fresh / f, shallow=False)]
    assert not drifted, f"generated files drifted from the protos: {drifted}; run clients/python/regenerate.sh"


def test_the_installed_package_is_the_committed_one():
    installed = Path(delegation_broker.__file__).parent
    files = sorted(_generated_files(COMMITTED)) + ["signing.py", "verify.py", "watch.py", "session.py", "errors.py", "retry.py",
                                                   "__init__.py"]
    stale = [f for f in files if not filecmp.cmp(COMMITTED / f, installed / f, shallow=False)]
    assert not stale, f"installed package at {installed} is stale: {stale}"


def test_every_rpc_of_every_service_is_on_its_stub():
    channel = grpc.insecure_channel("127.0.0.1:1")  # never connected
    for file_descriptor in {m.DESCRIPTOR.file for m in (pb.Contract, pb.DelegateBody)}:
        for service in file_descriptor.services_by_name.values():
            stub = getattr(pb, f"{service.name}Stub")(channel)
            for method in service.methods:
                assert callable(getattr(stub, method.name)), f"{service.full_name}/{method.name}"
    assert {m.name for m in pb.DelegateBody.DESCRIPTOR.file.services_by_name["Broker"].methods} >= {
        "OpenRoot", "Delegate", "GetContract", "GetChain", "ListChildren", "GetReceipt", "GetBrokerKeys"}
    channel.close()


def test_new_rpcs_and_files_are_picked_up_without_code_changes(tmp_path):
    """Regenerating from protos with an extra RPC and an extra file exposes both."""
    import shutil

    protos = tmp_path / "proto"
    shutil.copytree(PROTO_ROOT, protos)
    broker_proto = protos / "delegation" / "broker" / "v1" / "broker.proto"
    text = broker_proto.read_text()
    text = text.replace(
        "service Broker {",
        "service Broker {\n  // Test only.\n  rpc Ping(GetBrokerKeysRequest) returns (GetBrokerKeysResponse);",
    )
    broker_proto.write_text(text)
    (protos / "delegation" / "broker" / "v1" / "audit.proto").write_text(
        'syntax = "proto3";\npackage delegation.broker.v1;\nimport "delegation/broker/v1/types.proto";\n'
        "message AuditEntry { Envelope receipt = 1; }\n"
        "service Audit { rpc GetAudit(AuditEntry) returns (AuditEntry); }\n"
    )
    out = tmp_path / "delegation_broker"
    _regenerate_module().generate(protos, out)
    pb_text = (out / "pb.py").read_text()
    for name in ("AuditEntry", "AuditStub", "BrokerStub", "Contract"):
        assert f"    {name},\n" in pb_text
    assert "/delegation.broker.v1.Broker/Ping" in (out / "_gen/delegation/broker/v1/broker_pb2_grpc.py").read_text()
    audit = (out / "_gen/delegation/broker/v1/audit_pb2.py").read_text()
    assert "from delegation_broker._gen.delegation.broker.v1 import types_pb2" in audit
