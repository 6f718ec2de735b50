from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Liability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIABILITY_UNSPECIFIED: _ClassVar[Liability]
    LIABILITY_PRINCIPAL: _ClassVar[Liability]
    LIABILITY_DELEGATE: _ClassVar[Liability]

class TrustSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUST_SOURCE_UNSPECIFIED: _ClassVar[TrustSource]
    TRUST_SOURCE_ROOT: _ClassVar[TrustSource]
    TRUST_SOURCE_ATTESTATION: _ClassVar[TrustSource]
    TRUST_SOURCE_STATIC_TABLE: _ClassVar[TrustSource]
    TRUST_SOURCE_NONE: _ClassVar[TrustSource]

class InvariantCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INVARIANT_CODE_UNSPECIFIED: _ClassVar[InvariantCode]
    INVARIANT_CODE_PARENT_NOT_ACTIVE: _ClassVar[InvariantCode]
    INVARIANT_CODE_NOT_HOLDER: _ClassVar[InvariantCode]
    INVARIANT_CODE_DEPTH_EXCEEDED: _ClassVar[InvariantCode]
    INVARIANT_CODE_INTENT_DILUTED: _ClassVar[InvariantCode]
    INVARIANT_CODE_TRUST_ATTENUATED: _ClassVar[InvariantCode]
    INVARIANT_CODE_LIABILITY_WITHOUT_PREDICATE: _ClassVar[InvariantCode]
    INVARIANT_CODE_LIABILITY_WITHOUT_ESCALATION: _ClassVar[InvariantCode]
    INVARIANT_CODE_LIABILITY_FROM_RETAINING_PARENT: _ClassVar[InvariantCode]
    INVARIANT_CODE_BELOW_RETRY_COST: _ClassVar[InvariantCode]
    INVARIANT_CODE_BELOW_RETRY_LATENCY: _ClassVar[InvariantCode]
    INVARIANT_CODE_BUDGET_EXCEEDS_PARENT: _ClassVar[InvariantCode]
    INVARIANT_CODE_DEADLINE_EXCEEDS_PARENT: _ClassVar[InvariantCode]
    INVARIANT_CODE_NO_RETRY_HEADROOM: _ClassVar[InvariantCode]
    INVARIANT_CODE_SCOPE_WIDENED: _ClassVar[InvariantCode]
    INVARIANT_CODE_FANOUT_EXCEEDED: _ClassVar[InvariantCode]

class ReceiptKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECEIPT_KIND_UNSPECIFIED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_REFUSED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_ACCEPTED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_DECLINED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_COMPLETED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_ESCALATED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_REVOKED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_EXPIRED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_ADJUDICATED: _ClassVar[ReceiptKind]
    RECEIPT_KIND_OBSERVED: _ClassVar[ReceiptKind]

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    VERDICT_ACCEPTED: _ClassVar[Verdict]
    VERDICT_REJECTED: _ClassVar[Verdict]
    VERDICT_PENDING_PRINCIPAL: _ClassVar[Verdict]

class ObservationKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBSERVATION_KIND_UNSPECIFIED: _ClassVar[ObservationKind]
    OBSERVATION_KIND_TOOL_CALL: _ClassVar[ObservationKind]
    OBSERVATION_KIND_READ: _ClassVar[ObservationKind]
    OBSERVATION_KIND_MUTATION: _ClassVar[ObservationKind]

class ToolOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_OUTCOME_UNSPECIFIED: _ClassVar[ToolOutcome]
    TOOL_OUTCOME_SUCCEEDED: _ClassVar[ToolOutcome]
    TOOL_OUTCOME_FAILED: _ClassVar[ToolOutcome]
LIABILITY_UNSPECIFIED: Liability
LIABILITY_PRINCIPAL: Liability
LIABILITY_DELEGATE: Liability
TRUST_SOURCE_UNSPECIFIED: TrustSource
TRUST_SOURCE_ROOT: TrustSource
TRUST_SOURCE_ATTESTATION: TrustSource
TRUST_SOURCE_STATIC_TABLE: TrustSource
TRUST_SOURCE_NONE: TrustSource
INVARIANT_CODE_UNSPECIFIED: InvariantCode
INVARIANT_CODE_PARENT_NOT_ACTIVE: InvariantCode
INVARIANT_CODE_NOT_HOLDER: InvariantCode
INVARIANT_CODE_DEPTH_EXCEEDED: InvariantCode
INVARIANT_CODE_INTENT_DILUTED: InvariantCode
INVARIANT_CODE_TRUST_ATTENUATED: InvariantCode
INVARIANT_CODE_LIABILITY_WITHOUT_PREDICATE: InvariantCode
INVARIANT_CODE_LIABILITY_WITHOUT_ESCALATION: InvariantCode
INVARIANT_CODE_LIABILITY_FROM_RETAINING_PARENT: InvariantCode
INVARIANT_CODE_BELOW_RETRY_COST: InvariantCode
INVARIANT_CODE_BELOW_RETRY_LATENCY: InvariantCode
INVARIANT_CODE_BUDGET_EXCEEDS_PARENT: InvariantCode
INVARIANT_CODE_DEADLINE_EXCEEDS_PARENT: InvariantCode
INVARIANT_CODE_NO_RETRY_HEADROOM: InvariantCode
INVARIANT_CODE_SCOPE_WIDENED: InvariantCode
INVARIANT_CODE_FANOUT_EXCEEDED: InvariantCode
RECEIPT_KIND_UNSPECIFIED: ReceiptKind
RECEIPT_KIND_REFUSED: ReceiptKind
RECEIPT_KIND_ACCEPTED: ReceiptKind
RECEIPT_KIND_DECLINED: ReceiptKind
RECEIPT_KIND_COMPLETED: ReceiptKind
RECEIPT_KIND_ESCALATED: ReceiptKind
RECEIPT_KIND_REVOKED: ReceiptKind
RECEIPT_KIND_EXPIRED: ReceiptKind
RECEIPT_KIND_ADJUDICATED: ReceiptKind
RECEIPT_KIND_OBSERVED: ReceiptKind
VERDICT_UNSPECIFIED: Verdict
VERDICT_ACCEPTED: Verdict
VERDICT_REJECTED: Verdict
VERDICT_PENDING_PRINCIPAL: Verdict
OBSERVATION_KIND_UNSPECIFIED: ObservationKind
OBSERVATION_KIND_TOOL_CALL: ObservationKind
OBSERVATION_KIND_READ: ObservationKind
OBSERVATION_KIND_MUTATION: ObservationKind
TOOL_OUTCOME_UNSPECIFIED: ToolOutcome
TOOL_OUTCOME_SUCCEEDED: ToolOutcome
TOOL_OUTCOME_FAILED: ToolOutcome

class Envelope(_message.Message):
    __slots__ = ("payload_type", "payload", "signatures")
    PAYLOAD_TYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    payload_type: str
    payload: bytes
    signatures: _containers.RepeatedCompositeFieldContainer[Signature]
    def __init__(self, payload_type: _Optional[str] = ..., payload: _Optional[bytes] = ..., signatures: _Optional[_Iterable[_Union[Signature, _Mapping]]] = ...) -> None: ...

class Signature(_message.Message):
    __slots__ = ("keyid", "sig")
    KEYID_FIELD_NUMBER: _ClassVar[int]
    SIG_FIELD_NUMBER: _ClassVar[int]
    keyid: str
    sig: bytes
    def __init__(self, keyid: _Optional[str] = ..., sig: _Optional[bytes] = ...) -> None: ...

class Sealed(_message.Message):
    __slots__ = ("payload", "signature")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    signature: bytes
    def __init__(self, payload: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("max_depth", "min_cumulative_trust_ppm", "max_children", "disable_retry_headroom", "require_host")
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MIN_CUMULATIVE_TRUST_PPM_FIELD_NUMBER: _ClassVar[int]
    MAX_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    DISABLE_RETRY_HEADROOM_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_HOST_FIELD_NUMBER: _ClassVar[int]
    max_depth: int
    min_cumulative_trust_ppm: int
    max_children: int
    disable_retry_headroom: bool
    require_host: bool
    def __init__(self, max_depth: _Optional[int] = ..., min_cumulative_trust_ppm: _Optional[int] = ..., max_children: _Optional[int] = ..., disable_retry_headroom: _Optional[bool] = ..., require_host: _Optional[bool] = ...) -> None: ...

class Attestation(_message.Message):
    __slots__ = ("agent_public_key", "factor", "risk_class", "expires_at_ms", "not_before_ms")
    AGENT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    RISK_CLASS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_MS_FIELD_NUMBER: _ClassVar[int]
    agent_public_key: bytes
    factor: float
    risk_class: str
    expires_at_ms: int
    not_before_ms: int
    def __init__(self, agent_public_key: _Optional[bytes] = ..., factor: _Optional[float] = ..., risk_class: _Optional[str] = ..., expires_at_ms: _Optional[int] = ..., not_before_ms: _Optional[int] = ...) -> None: ...

class Contract(_message.Message):
    __slots__ = ("broker_key_id", "parent_id", "depth", "intent", "intent_lineage_hash", "task", "delegate_public_key", "budget", "deadline_ms", "issued_at_ms", "liability", "predicate", "escalation_channel", "min_retry_cost", "min_retry_latency_ms", "write_scope", "policy", "request_digest", "host_public_key", "result_schema_json", "labels", "factor_ppm", "cumulative_trust_ppm", "trust_source", "attestation_digest", "risk_class", "delegate_identity")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BROKER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    INTENT_LINEAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    DELEGATE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    LIABILITY_FIELD_NUMBER: _ClassVar[int]
    PREDICATE_FIELD_NUMBER: _ClassVar[int]
    ESCALATION_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    MIN_RETRY_COST_FIELD_NUMBER: _ClassVar[int]
    MIN_RETRY_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    HOST_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    RESULT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    FACTOR_PPM_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_TRUST_PPM_FIELD_NUMBER: _ClassVar[int]
    TRUST_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ATTESTATION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RISK_CLASS_FIELD_NUMBER: _ClassVar[int]
    DELEGATE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    broker_key_id: str
    parent_id: bytes
    depth: int
    intent: str
    intent_lineage_hash: bytes
    task: str
    delegate_public_key: bytes
    budget: int
    deadline_ms: int
    issued_at_ms: int
    liability: Liability
    predicate: str
    escalation_channel: str
    min_retry_cost: int
    min_retry_latency_ms: int
    write_scope: _containers.RepeatedScalarFieldContainer[str]
    policy: Policy
    request_digest: bytes
    host_public_key: bytes
    result_schema_json: str
    labels: _containers.ScalarMap[str, str]
    factor_ppm: int
    cumulative_trust_ppm: int
    trust_source: TrustSource
    attestation_digest: bytes
    risk_class: str
    delegate_identity: str
    def __init__(self, broker_key_id: _Optional[str] = ..., parent_id: _Optional[bytes] = ..., depth: _Optional[int] = ..., intent: _Optional[str] = ..., intent_lineage_hash: _Optional[bytes] = ..., task: _Optional[str] = ..., delegate_public_key: _Optional[bytes] = ..., budget: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., issued_at_ms: _Optional[int] = ..., liability: _Optional[_Union[Liability, str]] = ..., predicate: _Optional[str] = ..., escalation_channel: _Optional[str] = ..., min_retry_cost: _Optional[int] = ..., min_retry_latency_ms: _Optional[int] = ..., write_scope: _Optional[_Iterable[str]] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ..., request_digest: _Optional[bytes] = ..., host_public_key: _Optional[bytes] = ..., result_schema_json: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., factor_ppm: _Optional[int] = ..., cumulative_trust_ppm: _Optional[int] = ..., trust_source: _Optional[_Union[TrustSource, str]] = ..., attestation_digest: _Optional[bytes] = ..., risk_class: _Optional[str] = ..., delegate_identity: _Optional[str] = ...) -> None: ...

class Violation(_message.Message):
    __slots__ = ("code", "requested", "allowed", "detail")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    code: InvariantCode
    requested: str
    allowed: str
    detail: str
    def __init__(self, code: _Optional[_Union[InvariantCode, str]] = ..., requested: _Optional[str] = ..., allowed: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class RefusedCriterion(_message.Message):
    __slots__ = ("criterion", "reason")
    CRITERION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    criterion: str
    reason: str
    def __init__(self, criterion: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Attribution(_message.Message):
    __slots__ = ("agent_public_key", "depth", "chain")
    AGENT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    agent_public_key: bytes
    depth: int
    chain: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, agent_public_key: _Optional[bytes] = ..., depth: _Optional[int] = ..., chain: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("verdict", "refused_criteria", "claim", "has_report", "result_digest", "consumed", "overspend", "returned", "schema_valid", "within_scope", "out_of_scope_paths", "attribution", "elapsed_ms", "out_of_scope_path_count", "claimed_excess")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CRITERIA_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    HAS_REPORT_FIELD_NUMBER: _ClassVar[int]
    RESULT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    OVERSPEND_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VALID_FIELD_NUMBER: _ClassVar[int]
    WITHIN_SCOPE_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_SCOPE_PATHS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_SCOPE_PATH_COUNT_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_EXCESS_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    refused_criteria: _containers.RepeatedCompositeFieldContainer[RefusedCriterion]
    claim: str
    has_report: bool
    result_digest: bytes
    consumed: int
    overspend: int
    returned: int
    schema_valid: bool
    within_scope: bool
    out_of_scope_paths: _containers.RepeatedScalarFieldContainer[str]
    attribution: Attribution
    elapsed_ms: int
    out_of_scope_path_count: int
    claimed_excess: int
    def __init__(self, verdict: _Optional[_Union[Verdict, str]] = ..., refused_criteria: _Optional[_Iterable[_Union[RefusedCriterion, _Mapping]]] = ..., claim: _Optional[str] = ..., has_report: _Optional[bool] = ..., result_digest: _Optional[bytes] = ..., consumed: _Optional[int] = ..., overspend: _Optional[int] = ..., returned: _Optional[int] = ..., schema_valid: _Optional[bool] = ..., within_scope: _Optional[bool] = ..., out_of_scope_paths: _Optional[_Iterable[str]] = ..., attribution: _Optional[_Union[Attribution, _Mapping]] = ..., elapsed_ms: _Optional[int] = ..., out_of_scope_path_count: _Optional[int] = ..., claimed_excess: _Optional[int] = ...) -> None: ...

class EscalationNotice(_message.Message):
    __slots__ = ("principal_residual", "principal_deadline_ms", "retry_feasible", "reason")
    PRINCIPAL_RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    RETRY_FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    principal_residual: int
    principal_deadline_ms: int
    retry_feasible: bool
    reason: str
    def __init__(self, principal_residual: _Optional[int] = ..., principal_deadline_ms: _Optional[int] = ..., retry_feasible: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("broker_key_id", "kind", "contract_id", "root_id", "request_digest", "requester_public_key", "at_ms", "primary", "violations", "completion", "escalation", "reason", "revoked_ids", "observations")
    BROKER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ESCALATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REVOKED_IDS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    broker_key_id: str
    kind: ReceiptKind
    contract_id: bytes
    root_id: bytes
    request_digest: bytes
    requester_public_key: bytes
    at_ms: int
    primary: InvariantCode
    violations: _containers.RepeatedCompositeFieldContainer[Violation]
    completion: Completion
    escalation: EscalationNotice
    reason: str
    revoked_ids: _containers.RepeatedScalarFieldContainer[bytes]
    observations: int
    def __init__(self, broker_key_id: _Optional[str] = ..., kind: _Optional[_Union[ReceiptKind, str]] = ..., contract_id: _Optional[bytes] = ..., root_id: _Optional[bytes] = ..., request_digest: _Optional[bytes] = ..., requester_public_key: _Optional[bytes] = ..., at_ms: _Optional[int] = ..., primary: _Optional[_Union[InvariantCode, str]] = ..., violations: _Optional[_Iterable[_Union[Violation, _Mapping]]] = ..., completion: _Optional[_Union[Completion, _Mapping]] = ..., escalation: _Optional[_Union[EscalationNotice, _Mapping]] = ..., reason: _Optional[str] = ..., revoked_ids: _Optional[_Iterable[bytes]] = ..., observations: _Optional[int] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("kind", "path", "tool", "units", "at_ms", "arguments_sha256", "outcome")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    kind: ObservationKind
    path: str
    tool: str
    units: int
    at_ms: int
    arguments_sha256: bytes
    outcome: ToolOutcome
    def __init__(self, kind: _Optional[_Union[ObservationKind, str]] = ..., path: _Optional[str] = ..., tool: _Optional[str] = ..., units: _Optional[int] = ..., at_ms: _Optional[int] = ..., arguments_sha256: _Optional[bytes] = ..., outcome: _Optional[_Union[ToolOutcome, str]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("broker_key_id", "agent_public_key", "issued_at_ms", "expires_at_ms")
    BROKER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    broker_key_id: str
    agent_public_key: bytes
    issued_at_ms: int
    expires_at_ms: int
    def __init__(self, broker_key_id: _Optional[str] = ..., agent_public_key: _Optional[bytes] = ..., issued_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ...) -> None: ...

class RequestHeader(_message.Message):
    __slots__ = ("agent_public_key", "timestamp_ms", "nonce")
    AGENT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    agent_public_key: bytes
    timestamp_ms: int
    nonce: bytes
    def __init__(self, agent_public_key: _Optional[bytes] = ..., timestamp_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...
