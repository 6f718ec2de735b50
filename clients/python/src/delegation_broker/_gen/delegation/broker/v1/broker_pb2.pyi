from delegation_broker._gen.delegation.broker.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ContractStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTRACT_STATUS_UNSPECIFIED: _ClassVar[ContractStatus]
    CONTRACT_STATUS_OPEN: _ClassVar[ContractStatus]
    CONTRACT_STATUS_ACCEPTED: _ClassVar[ContractStatus]
    CONTRACT_STATUS_COMPLETED: _ClassVar[ContractStatus]
    CONTRACT_STATUS_UNRESOLVABLE: _ClassVar[ContractStatus]
    CONTRACT_STATUS_EXPIRED: _ClassVar[ContractStatus]
    CONTRACT_STATUS_REVOKED: _ClassVar[ContractStatus]
    CONTRACT_STATUS_DECLINED: _ClassVar[ContractStatus]

class HeldRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HELD_ROLE_UNSPECIFIED: _ClassVar[HeldRole]
    HELD_ROLE_DELEGATE: _ClassVar[HeldRole]
    HELD_ROLE_HOST: _ClassVar[HeldRole]
CONTRACT_STATUS_UNSPECIFIED: ContractStatus
CONTRACT_STATUS_OPEN: ContractStatus
CONTRACT_STATUS_ACCEPTED: ContractStatus
CONTRACT_STATUS_COMPLETED: ContractStatus
CONTRACT_STATUS_UNRESOLVABLE: ContractStatus
CONTRACT_STATUS_EXPIRED: ContractStatus
CONTRACT_STATUS_REVOKED: ContractStatus
CONTRACT_STATUS_DECLINED: ContractStatus
HELD_ROLE_UNSPECIFIED: HeldRole
HELD_ROLE_DELEGATE: HeldRole
HELD_ROLE_HOST: HeldRole

class OpenRootBody(_message.Message):
    __slots__ = ("header", "intent", "task", "budget", "deadline_ms", "policy", "predicate", "write_scope", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREDICATE_FIELD_NUMBER: _ClassVar[int]
    WRITE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    intent: str
    task: str
    budget: int
    deadline_ms: int
    policy: _types_pb2.Policy
    predicate: str
    write_scope: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., intent: _Optional[str] = ..., task: _Optional[str] = ..., budget: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., policy: _Optional[_Union[_types_pb2.Policy, _Mapping]] = ..., predicate: _Optional[str] = ..., write_scope: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OpenRootRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class OpenRootResponse(_message.Message):
    __slots__ = ("issued", "replayed")
    ISSUED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    issued: IssuedContract
    replayed: bool
    def __init__(self, issued: _Optional[_Union[IssuedContract, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class DelegateBody(_message.Message):
    __slots__ = ("header", "parent_id", "intent_lineage_hash", "task", "delegate_public_key", "delegate_attestation", "budget", "deadline_ms", "liability", "predicate", "escalation_channel", "min_retry_cost", "min_retry_latency_ms", "write_scope", "host_public_key", "result_schema_json")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    INTENT_LINEAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    DELEGATE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    DELEGATE_ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LIABILITY_FIELD_NUMBER: _ClassVar[int]
    PREDICATE_FIELD_NUMBER: _ClassVar[int]
    ESCALATION_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    MIN_RETRY_COST_FIELD_NUMBER: _ClassVar[int]
    MIN_RETRY_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    HOST_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    RESULT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    parent_id: bytes
    intent_lineage_hash: bytes
    task: str
    delegate_public_key: bytes
    delegate_attestation: _types_pb2.Envelope
    budget: int
    deadline_ms: int
    liability: _types_pb2.Liability
    predicate: str
    escalation_channel: str
    min_retry_cost: int
    min_retry_latency_ms: int
    write_scope: _containers.RepeatedScalarFieldContainer[str]
    host_public_key: bytes
    result_schema_json: str
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., parent_id: _Optional[bytes] = ..., intent_lineage_hash: _Optional[bytes] = ..., task: _Optional[str] = ..., delegate_public_key: _Optional[bytes] = ..., delegate_attestation: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., budget: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., liability: _Optional[_Union[_types_pb2.Liability, str]] = ..., predicate: _Optional[str] = ..., escalation_channel: _Optional[str] = ..., min_retry_cost: _Optional[int] = ..., min_retry_latency_ms: _Optional[int] = ..., write_scope: _Optional[_Iterable[str]] = ..., host_public_key: _Optional[bytes] = ..., result_schema_json: _Optional[str] = ...) -> None: ...

class DelegateRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class IssuedContract(_message.Message):
    __slots__ = ("contract_id", "contract")
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    contract_id: bytes
    contract: _types_pb2.Sealed
    def __init__(self, contract_id: _Optional[bytes] = ..., contract: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("receipt_id", "receipt")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    receipt: _types_pb2.Sealed
    def __init__(self, receipt_id: _Optional[bytes] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ...) -> None: ...

class DelegateResponse(_message.Message):
    __slots__ = ("issued", "refused", "replayed")
    ISSUED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    issued: IssuedContract
    refused: Refusal
    replayed: bool
    def __init__(self, issued: _Optional[_Union[IssuedContract, _Mapping]] = ..., refused: _Optional[_Union[Refusal, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class Ledger(_message.Message):
    __slots__ = ("budget", "reserved", "spent", "residual", "open_children")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    SPENT_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    OPEN_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    budget: int
    reserved: int
    spent: int
    residual: int
    open_children: int
    def __init__(self, budget: _Optional[int] = ..., reserved: _Optional[int] = ..., spent: _Optional[int] = ..., residual: _Optional[int] = ..., open_children: _Optional[int] = ...) -> None: ...

class ContractState(_message.Message):
    __slots__ = ("contract_id", "contract", "status", "ledger", "effective_predicate", "host_public_key", "tenant")
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_PREDICATE_FIELD_NUMBER: _ClassVar[int]
    HOST_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    contract_id: bytes
    contract: _types_pb2.Sealed
    status: ContractStatus
    ledger: Ledger
    effective_predicate: str
    host_public_key: bytes
    tenant: str
    def __init__(self, contract_id: _Optional[bytes] = ..., contract: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., status: _Optional[_Union[ContractStatus, str]] = ..., ledger: _Optional[_Union[Ledger, _Mapping]] = ..., effective_predicate: _Optional[str] = ..., host_public_key: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class OpenSessionBody(_message.Message):
    __slots__ = ("header", "broker_key_id")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BROKER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    broker_key_id: str
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., broker_key_id: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session", "expires_at_ms")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    session: _types_pb2.Sealed
    expires_at_ms: int
    def __init__(self, session: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., expires_at_ms: _Optional[int] = ...) -> None: ...

class BindIdentityRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class BindIdentityBody(_message.Message):
    __slots__ = ("header", "token")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    token: str
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., token: _Optional[str] = ...) -> None: ...

class BindIdentityResponse(_message.Message):
    __slots__ = ("identity", "issuer", "expires_at_ms")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ISSUER_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    identity: str
    issuer: str
    expires_at_ms: int
    def __init__(self, identity: _Optional[str] = ..., issuer: _Optional[str] = ..., expires_at_ms: _Optional[int] = ...) -> None: ...

class GetContractRequest(_message.Message):
    __slots__ = ("contract_id",)
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    contract_id: bytes
    def __init__(self, contract_id: _Optional[bytes] = ...) -> None: ...

class GetContractResponse(_message.Message):
    __slots__ = ("contract",)
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    contract: ContractState
    def __init__(self, contract: _Optional[_Union[ContractState, _Mapping]] = ...) -> None: ...

class GetChainRequest(_message.Message):
    __slots__ = ("contract_id",)
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    contract_id: bytes
    def __init__(self, contract_id: _Optional[bytes] = ...) -> None: ...

class GetChainResponse(_message.Message):
    __slots__ = ("chain",)
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    chain: _containers.RepeatedCompositeFieldContainer[ContractState]
    def __init__(self, chain: _Optional[_Iterable[_Union[ContractState, _Mapping]]] = ...) -> None: ...

class ListChildrenRequest(_message.Message):
    __slots__ = ("contract_id", "page_size", "page_token")
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    contract_id: bytes
    page_size: int
    page_token: bytes
    def __init__(self, contract_id: _Optional[bytes] = ..., page_size: _Optional[int] = ..., page_token: _Optional[bytes] = ...) -> None: ...

class ListChildrenResponse(_message.Message):
    __slots__ = ("children", "next_page_token")
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    children: _containers.RepeatedCompositeFieldContainer[ContractState]
    next_page_token: bytes
    def __init__(self, children: _Optional[_Iterable[_Union[ContractState, _Mapping]]] = ..., next_page_token: _Optional[bytes] = ...) -> None: ...

class ListRootsRequest(_message.Message):
    __slots__ = ("labels", "page_size", "page_token")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    page_size: int
    page_token: bytes
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[bytes] = ...) -> None: ...

class ListRootsResponse(_message.Message):
    __slots__ = ("roots", "next_page_token")
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    roots: _containers.RepeatedCompositeFieldContainer[ContractState]
    next_page_token: bytes
    def __init__(self, roots: _Optional[_Iterable[_Union[ContractState, _Mapping]]] = ..., next_page_token: _Optional[bytes] = ...) -> None: ...

class ListHeldRequest(_message.Message):
    __slots__ = ("role", "page_size", "page_token")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    role: HeldRole
    page_size: int
    page_token: bytes
    def __init__(self, role: _Optional[_Union[HeldRole, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[bytes] = ...) -> None: ...

class ListHeldResponse(_message.Message):
    __slots__ = ("contracts", "next_page_token")
    CONTRACTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    contracts: _containers.RepeatedCompositeFieldContainer[ContractState]
    next_page_token: bytes
    def __init__(self, contracts: _Optional[_Iterable[_Union[ContractState, _Mapping]]] = ..., next_page_token: _Optional[bytes] = ...) -> None: ...

class GetReceiptRequest(_message.Message):
    __slots__ = ("receipt_id",)
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    def __init__(self, receipt_id: _Optional[bytes] = ...) -> None: ...

class GetReceiptResponse(_message.Message):
    __slots__ = ("receipt",)
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    receipt: _types_pb2.Sealed
    def __init__(self, receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ...) -> None: ...

class GetBrokerKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BrokerKey(_message.Message):
    __slots__ = ("key_id", "public_key", "current", "retired_at_ms")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    RETIRED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    public_key: bytes
    current: bool
    retired_at_ms: int
    def __init__(self, key_id: _Optional[str] = ..., public_key: _Optional[bytes] = ..., current: _Optional[bool] = ..., retired_at_ms: _Optional[int] = ...) -> None: ...

class GetBrokerKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[BrokerKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[BrokerKey, _Mapping]]] = ...) -> None: ...

class TypedReport(_message.Message):
    __slots__ = ("status", "summary")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    status: str
    summary: str
    def __init__(self, status: _Optional[str] = ..., summary: _Optional[str] = ...) -> None: ...

class AcceptBody(_message.Message):
    __slots__ = ("header", "contract_id", "host_public_key")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    contract_id: bytes
    host_public_key: bytes
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., contract_id: _Optional[bytes] = ..., host_public_key: _Optional[bytes] = ...) -> None: ...

class AcceptRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class AcceptResponse(_message.Message):
    __slots__ = ("receipt_id", "receipt", "replayed")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    receipt: _types_pb2.Sealed
    replayed: bool
    def __init__(self, receipt_id: _Optional[bytes] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class DeclineBody(_message.Message):
    __slots__ = ("header", "contract_id", "reason")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    contract_id: bytes
    reason: str
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., contract_id: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class DeclineRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class DeclineResponse(_message.Message):
    __slots__ = ("receipt_id", "receipt", "replayed")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    receipt: _types_pb2.Sealed
    replayed: bool
    def __init__(self, receipt_id: _Optional[bytes] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class CompleteBody(_message.Message):
    __slots__ = ("header", "contract_id", "output_json", "report", "claim", "consumed")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    contract_id: bytes
    output_json: str
    report: TypedReport
    claim: str
    consumed: int
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., contract_id: _Optional[bytes] = ..., output_json: _Optional[str] = ..., report: _Optional[_Union[TypedReport, _Mapping]] = ..., claim: _Optional[str] = ..., consumed: _Optional[int] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("receipt_id", "receipt", "replayed")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    receipt: _types_pb2.Sealed
    replayed: bool
    def __init__(self, receipt_id: _Optional[bytes] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class AdjudicateBody(_message.Message):
    __slots__ = ("header", "contract_id", "verdict", "reason")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    contract_id: bytes
    verdict: _types_pb2.Verdict
    reason: str
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., contract_id: _Optional[bytes] = ..., verdict: _Optional[_Union[_types_pb2.Verdict, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class AdjudicateRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class AdjudicateResponse(_message.Message):
    __slots__ = ("receipt_id", "receipt", "replayed")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    receipt: _types_pb2.Sealed
    replayed: bool
    def __init__(self, receipt_id: _Optional[bytes] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class EscalateBody(_message.Message):
    __slots__ = ("header", "contract_id", "reason")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    contract_id: bytes
    reason: str
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., contract_id: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class EscalateRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class EscalateResponse(_message.Message):
    __slots__ = ("receipt_id", "receipt", "replayed")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    receipt: _types_pb2.Sealed
    replayed: bool
    def __init__(self, receipt_id: _Optional[bytes] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class RevokeBody(_message.Message):
    __slots__ = ("header", "contract_id", "reason")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    contract_id: bytes
    reason: str
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., contract_id: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("receipt_id", "receipt", "replayed")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    receipt: _types_pb2.Sealed
    replayed: bool
    def __init__(self, receipt_id: _Optional[bytes] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class RecordReceiptsBody(_message.Message):
    __slots__ = ("header", "contract_id", "observations")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    header: _types_pb2.RequestHeader
    contract_id: bytes
    observations: _containers.RepeatedCompositeFieldContainer[_types_pb2.Observation]
    def __init__(self, header: _Optional[_Union[_types_pb2.RequestHeader, _Mapping]] = ..., contract_id: _Optional[bytes] = ..., observations: _Optional[_Iterable[_Union[_types_pb2.Observation, _Mapping]]] = ...) -> None: ...

class RecordReceiptsRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _types_pb2.Envelope
    def __init__(self, signed: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class RecordReceiptsResponse(_message.Message):
    __slots__ = ("receipt_id", "receipt", "replayed")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    receipt_id: bytes
    receipt: _types_pb2.Sealed
    replayed: bool
    def __init__(self, receipt_id: _Optional[bytes] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("contract_id", "cursor")
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    contract_id: bytes
    cursor: int
    def __init__(self, contract_id: _Optional[bytes] = ..., cursor: _Optional[int] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("cursor", "contract", "receipt")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    contract: _types_pb2.Sealed
    receipt: _types_pb2.Sealed
    def __init__(self, cursor: _Optional[int] = ..., contract: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ..., receipt: _Optional[_Union[_types_pb2.Sealed, _Mapping]] = ...) -> None: ...

class WatchContractsRequest(_message.Message):
    __slots__ = ("add_contract_ids", "remove_contract_ids")
    ADD_CONTRACT_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_CONTRACT_IDS_FIELD_NUMBER: _ClassVar[int]
    add_contract_ids: _containers.RepeatedScalarFieldContainer[bytes]
    remove_contract_ids: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, add_contract_ids: _Optional[_Iterable[bytes]] = ..., remove_contract_ids: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WatchContractsResponse(_message.Message):
    __slots__ = ("contract",)
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    contract: ContractState
    def __init__(self, contract: _Optional[_Union[ContractState, _Mapping]] = ...) -> None: ...

class GetAuditRequest(_message.Message):
    __slots__ = ("contract_id",)
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    contract_id: bytes
    def __init__(self, contract_id: _Optional[bytes] = ...) -> None: ...

class GetAuditResponse(_message.Message):
    __slots__ = ("audit",)
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    audit: ContractAudit
    def __init__(self, audit: _Optional[_Union[ContractAudit, _Mapping]] = ...) -> None: ...

class AuditConflict(_message.Message):
    __slots__ = ("path", "other_contract_ids")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OTHER_CONTRACT_IDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    other_contract_ids: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, path: _Optional[str] = ..., other_contract_ids: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ContractAudit(_message.Message):
    __slots__ = ("contract_id", "depth", "tool_calls", "mutations", "mutation_paths", "claim_violations", "completed", "has_report", "downgrades", "parent_scope_hints", "parent_named_files", "evidence_paths", "discovered_paths", "false_completion", "conflicts", "verdict", "claim", "named_scope_hints", "named_files", "mutation_path_count", "conflict_count", "delegate_identity")
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    MUTATIONS_FIELD_NUMBER: _ClassVar[int]
    MUTATION_PATHS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    HAS_REPORT_FIELD_NUMBER: _ClassVar[int]
    DOWNGRADES_FIELD_NUMBER: _ClassVar[int]
    PARENT_SCOPE_HINTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_NAMED_FILES_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_PATHS_FIELD_NUMBER: _ClassVar[int]
    DISCOVERED_PATHS_FIELD_NUMBER: _ClassVar[int]
    FALSE_COMPLETION_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    NAMED_SCOPE_HINTS_FIELD_NUMBER: _ClassVar[int]
    NAMED_FILES_FIELD_NUMBER: _ClassVar[int]
    MUTATION_PATH_COUNT_FIELD_NUMBER: _ClassVar[int]
    CONFLICT_COUNT_FIELD_NUMBER: _ClassVar[int]
    DELEGATE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    contract_id: bytes
    depth: int
    tool_calls: int
    mutations: int
    mutation_paths: _containers.RepeatedScalarFieldContainer[str]
    claim_violations: int
    completed: bool
    has_report: bool
    downgrades: int
    parent_scope_hints: int
    parent_named_files: int
    evidence_paths: int
    discovered_paths: int
    false_completion: bool
    conflicts: _containers.RepeatedCompositeFieldContainer[AuditConflict]
    verdict: _types_pb2.Verdict
    claim: str
    named_scope_hints: _containers.RepeatedScalarFieldContainer[str]
    named_files: _containers.RepeatedScalarFieldContainer[str]
    mutation_path_count: int
    conflict_count: int
    delegate_identity: str
    def __init__(self, contract_id: _Optional[bytes] = ..., depth: _Optional[int] = ..., tool_calls: _Optional[int] = ..., mutations: _Optional[int] = ..., mutation_paths: _Optional[_Iterable[str]] = ..., claim_violations: _Optional[int] = ..., completed: _Optional[bool] = ..., has_report: _Optional[bool] = ..., downgrades: _Optional[int] = ..., parent_scope_hints: _Optional[int] = ..., parent_named_files: _Optional[int] = ..., evidence_paths: _Optional[int] = ..., discovered_paths: _Optional[int] = ..., false_completion: _Optional[bool] = ..., conflicts: _Optional[_Iterable[_Union[AuditConflict, _Mapping]]] = ..., verdict: _Optional[_Union[_types_pb2.Verdict, str]] = ..., claim: _Optional[str] = ..., named_scope_hints: _Optional[_Iterable[str]] = ..., named_files: _Optional[_Iterable[str]] = ..., mutation_path_count: _Optional[int] = ..., conflict_count: _Optional[int] = ..., delegate_identity: _Optional[str] = ...) -> None: ...

class AggregateAuditsRequest(_message.Message):
    __slots__ = ("selector", "group_by")
    class SelectorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    GROUP_BY_FIELD_NUMBER: _ClassVar[int]
    selector: _containers.ScalarMap[str, str]
    group_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, selector: _Optional[_Mapping[str, str]] = ..., group_by: _Optional[_Iterable[str]] = ...) -> None: ...

class AuditGroup(_message.Message):
    __slots__ = ("key", "runs", "contracts", "discovered_paths", "evidence_paths", "discovery_rate", "with_report", "false_completions", "false_completion_rate", "claim_violations", "mutations", "claim_violations_per_mutation", "conflicts", "escalations", "refusals_by_code", "budget_spent", "budget_granted", "spent_over_granted")
    class KeyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class RefusalsByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    CONTRACTS_FIELD_NUMBER: _ClassVar[int]
    DISCOVERED_PATHS_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_PATHS_FIELD_NUMBER: _ClassVar[int]
    DISCOVERY_RATE_FIELD_NUMBER: _ClassVar[int]
    WITH_REPORT_FIELD_NUMBER: _ClassVar[int]
    FALSE_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    FALSE_COMPLETION_RATE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    MUTATIONS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_VIOLATIONS_PER_MUTATION_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    ESCALATIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_SPENT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_GRANTED_FIELD_NUMBER: _ClassVar[int]
    SPENT_OVER_GRANTED_FIELD_NUMBER: _ClassVar[int]
    key: _containers.ScalarMap[str, str]
    runs: int
    contracts: int
    discovered_paths: int
    evidence_paths: int
    discovery_rate: float
    with_report: int
    false_completions: int
    false_completion_rate: float
    claim_violations: int
    mutations: int
    claim_violations_per_mutation: float
    conflicts: int
    escalations: int
    refusals_by_code: _containers.ScalarMap[str, int]
    budget_spent: int
    budget_granted: int
    spent_over_granted: float
    def __init__(self, key: _Optional[_Mapping[str, str]] = ..., runs: _Optional[int] = ..., contracts: _Optional[int] = ..., discovered_paths: _Optional[int] = ..., evidence_paths: _Optional[int] = ..., discovery_rate: _Optional[float] = ..., with_report: _Optional[int] = ..., false_completions: _Optional[int] = ..., false_completion_rate: _Optional[float] = ..., claim_violations: _Optional[int] = ..., mutations: _Optional[int] = ..., claim_violations_per_mutation: _Optional[float] = ..., conflicts: _Optional[int] = ..., escalations: _Optional[int] = ..., refusals_by_code: _Optional[_Mapping[str, int]] = ..., budget_spent: _Optional[int] = ..., budget_granted: _Optional[int] = ..., spent_over_granted: _Optional[float] = ...) -> None: ...

class AggregateAuditsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[AuditGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[AuditGroup, _Mapping]]] = ...) -> None: ...
