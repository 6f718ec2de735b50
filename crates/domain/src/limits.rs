//! Every bound the broker enforces on what a client sends, in one place.
//! Config values that an operator may tune live in `config`; these are the
//! hard ceilings the code relies on (overflow, memory, row sizes).

/// Largest budget, reserve, cost or metered consumption, in units (10^15).
/// Far below `i64::MAX` (~9.2 × 10^18) so sums of a full fan-out stay
/// representable; ledger arithmetic saturates beyond that anyway.
pub const MAX_BUDGET_UNITS: i64 = 10_i64.pow(15);
/// Largest intent or task text, in bytes.
pub const MAX_TEXT_BYTES: usize = 16_384;
/// Largest forwarded predicate, in bytes.
pub const MAX_PREDICATE_BYTES: usize = 4_096;
/// Predicate texts remembered as parsed, in bytes (`Predicate::parse`).
pub const MAX_PARSED_PREDICATE_BYTES: usize = 1024 * 1024;
/// Effective predicates (and their parts) remembered with their shape, in
/// bytes (`Predicate::check_effective`): a few MiB hold every composition
/// of thousands of chains, each at most `MAX_EFFECTIVE_PREDICATE_BYTES`.
pub const MAX_SHAPE_MEMO_BYTES: usize = 8 * 1024 * 1024;
/// Largest effective (composed) predicate, in bytes: bounds what a deep
/// chain of conjunctions can grow to.
pub const MAX_EFFECTIVE_PREDICATE_BYTES: usize = 65_536;
/// Largest escalation channel name, in bytes.
pub const MAX_CHANNEL_BYTES: usize = 1_024;
/// Most write-scope prefixes on one contract.
pub const MAX_SCOPE_PREFIXES: usize = 64;
/// Longest write-scope prefix, in bytes.
pub const MAX_SCOPE_PREFIX_BYTES: usize = 1_024;
/// Longest risk class in an attestation, in bytes.
pub const MAX_RISK_CLASS_BYTES: usize = 64;
/// Hard ceiling for a policy's `max_depth`.
pub const MAX_DEPTH_CEILING: u32 = 64;
/// Hard ceiling for a policy's `max_children`.
pub const MAX_CHILDREN_CEILING: u32 = 1_024;
/// Longest a deadline (or a retry latency) may be from now: 366 days.
pub const MAX_HORIZON_MS: i64 = 366 * 24 * 3600 * 1000;
/// Nonce length bounds, in bytes.
pub const MIN_NONCE_BYTES: usize = 16;
pub const MAX_NONCE_BYTES: usize = 64;
/// Trust is carried in parts per million; this is "full trust".
pub const PPM_ONE: u32 = 1_000_000;
/// Largest page of children returned at once.
pub const MAX_PAGE_SIZE: u32 = 1_000;
/// Contracts one WatchContracts stream watches at once: its memory and
/// the work of each scan.
pub const MAX_WATCHED_CONTRACTS: usize = 4_096;
/// Contracts one WatchContracts message may add and remove.
pub const MAX_WATCH_CONTRACTS_PER_MESSAGE: usize = 1_024;
/// Page size when the client asks for 0.
pub const DEFAULT_PAGE_SIZE: u32 = 100;
/// Most roots one ListRoots call looks at, shown or not: a caller who is a
/// party of few trees among many gets short (even empty) pages with a next
/// token, never a scan of every root.
pub const MAX_ROOTS_SCANNED: u32 = 1_000;
/// Largest completion result (the delegate's JSON output), serialized, in
/// bytes.
pub const MAX_RESULT_BYTES: usize = 256 * 1024;
/// Deepest nesting of arrays and objects in a completion result. Bounds the
/// recursion that converts it for predicate evaluation.
pub const MAX_RESULT_DEPTH: usize = 64;
/// Largest JSON Schema a contract may name, serialized, in bytes.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// Deepest nesting of arrays and objects in a JSON Schema.
pub const MAX_SCHEMA_DEPTH: usize = 64;
/// Largest compiled form of one schema `pattern` (or `patternProperties`
/// key), in bytes (the regex engine's size limit). One Unicode-wide class
/// fits (`[\p{L}\p{N}]` takes ~48 KB); `[\p{L}\p{N}]{50}N` needs 2.3 MB
/// and is refused at once instead of taking seconds to build. A pattern at
/// the limit compiles in ~2 ms in a debug build.
pub const REGEX_SIZE_LIMIT_BYTES: usize = 64 * 1024;
/// Cache of one pattern's lazy DFA, per thread using it, in bytes. Small:
/// a pattern whose DFA outgrows it falls back to the engine's linear-time
/// simulation, which the work estimate charges for (`core::schema`).
pub const REGEX_DFA_SIZE_LIMIT_BYTES: usize = 64 * 1024;

/// Judgments of one contract's completions the host may make stale by
/// recording while they are judged (each is judged again): past it the
/// contract takes no more observations while it is ACCEPTED, so the next
/// judgment holds (`RECORDING_CLOSED`). Three completions' worth.
pub const MAX_STALE_JUDGMENTS: i64 = 9;

/// Longest string a result schema's `"format": "regex"` assertion accepts:
/// the broker checks it as a pattern itself (`core::schema`), linearly,
/// instead of the validator library's check, which is quadratic in nested
/// groups (a 250 KB string of 32,000 nested named groups took 1.8 s).
pub const MAX_REGEX_FORMAT_BYTES: usize = 4_096;
/// Deepest nesting a `"format": "regex"` string may have.
pub const MAX_REGEX_FORMAT_NEST: u32 = 64;
/// Most distinct patterns in one schema: 64 patterns each just under
/// `REGEX_SIZE_LIMIT_BYTES` compile in ~0.15 s in a debug build (was 37 s
/// for one 58 KB schema with no limits), and a compiled schema holds at
/// most 4 MiB of them. Honest schemas use a handful.
pub const MAX_SCHEMA_PATTERNS: usize = 64;
/// Most schema nodes applied, summed over the output's depths, to the
/// output nodes along any one path from its root (`core::schema`'s
/// profile), checked at issuance. Honest schemas need tens to hundreds (a
/// recursive tree schema: a few per depth); a chain of two-way `anyOf`s
/// doubles per level and exceeds it after 13 levels. It also bounds the
/// validator's recursion: at most this many nested applications, ~1 KiB of
/// stack each in a debug build, far inside the judge threads' 64 MiB.
pub const MAX_SCHEMA_EXPANSION: u64 = 10_000;
/// Work budget of validating one output against its schema, in the units of
/// `core::schema::Profile::work` (roughly: schema keywords × output bytes
/// they examine). Past it the output is not validated and is not valid.
/// Measured in a debug build, a unit costs ~0.5-0.7 ns for ordinary
/// keywords and up to ~36 ns for the worst kind (a regex position stepped
/// over a byte once the lazy DFA gives up), so 20,000,000 units take at
/// most ~0.7 s of a core, usually ~15 ms; a 140 KB output of 2,000 typed
/// objects needs 2.7 million.
pub const MAX_SCHEMA_WORK: u64 = 20_000_000;
/// Compiled schemas remembered (`core::schema::compile`): contracts of a
/// run share a few schemas, and each compile costs up to ~0.15 s.
pub const MAX_COMPILED_SCHEMAS: usize = 1_024;
/// What the remembered compiled schemas may hold, in bytes, as charged by
/// `core::schema` (schema text × 32, ~27 measured, plus every pattern at its
/// size and DFA limits): at least six of the largest schemas, hundreds of
/// ordinary ones.
pub const MAX_COMPILED_SCHEMA_BYTES: usize = 64 * 1024 * 1024;
/// Longest delegate claim ("success", "partial", ...), in bytes.
pub const MAX_CLAIM_BYTES: usize = 256;
/// Schema validation messages kept on a judgment: enough to say why.
pub const MAX_SCHEMA_ERRORS_REPORTED: usize = 8;
/// Most out-of-scope paths a completion receipt names (it also carries
/// their total count).
pub const MAX_OUT_OF_SCOPE_PATHS_REPORTED: usize = 64;
/// Deepest predicate syntax tree the judge evaluates; the evaluator recurses
/// once per level.
pub const MAX_PREDICATE_AST_DEPTH: usize = 128;
/// Work budget of one judgment's predicate evaluation, in cost units (see
/// `judge`): every value read is charged its size, every comprehension its
/// iterations times its body. Bounds CPU and memory whatever the predicate
/// and the result are.
pub const MAX_PREDICATE_COST: u64 = 1_000_000;
/// Cost of one `matches` call, which compiles its pattern every time, and
/// the extra cost per pattern character (compilation grows with it).
pub const REGEX_CALL_COST: i64 = 1_000;
pub const REGEX_BYTE_COST: i64 = 64;
/// Largest compiled NFA of a `matches` pattern, in bytes: counted
/// repetitions (`a[ab]{10000}`) blow a short pattern up to a huge
/// automaton, and matching time grows with its size.
pub const MAX_REGEX_NFA_BYTES: usize = 256 * 1024;
/// Distinct `matches` patterns one judgment compiles: each may hold up to
/// `MAX_REGEX_NFA_BYTES` plus its cache.
pub const MAX_PATTERNS_PER_JUDGMENT: usize = 16;
/// The lazy DFA's cache of one `matches` pattern, in bytes.
pub const REGEX_DFA_CACHE_BYTES: usize = 256 * 1024;
/// NFA states per cost unit per matched byte: matching is charged, before
/// it runs, at the engine's worst case (text length × states), so a match
/// over 255 KB with a 10,000-state pattern (23 s before) is refused.
pub const REGEX_STATES_PER_UNIT: u64 = 16;
/// Wall time of one judgment's predicate evaluation, in ms: the cost meter
/// bounds work, this bounds what its accounting could miss. Past it the
/// conjunct being evaluated (and any after it) is refused.
pub const MAX_JUDGMENT_MS: u64 = 2_000;
/// Longest a completion's output is validated against its schema: past
/// it, every schema node the validator enters fails at once and the output
/// is not valid (the work estimate, `MAX_SCHEMA_WORK`, is checked first;
/// this bounds what an estimate missed).
pub const MAX_SCHEMA_VALIDATION_MS: u64 = 1_000;
/// Most host observations recorded for one contract (RecordReceipts is
/// append-only; this bounds a contract's rows and its judgment's work).
pub const MAX_OBSERVATIONS_PER_CONTRACT: i64 = 10_000;
/// Most observations in one RecordReceipts request.
pub const MAX_OBSERVATIONS_PER_REQUEST: usize = 256;
/// Longest observed path, in bytes.
pub const MAX_OBSERVED_PATH_BYTES: usize = 1_024;
/// Longest observed tool name, in bytes.
pub const MAX_TOOL_NAME_BYTES: usize = 256;
/// Longest reason text (decline, escalate, revoke, adjudicate), in bytes.
pub const MAX_REASON_BYTES: usize = 1_024;
/// Deepest bracket nesting ((), [], {}) in a forwarded predicate. The CEL
/// parser recurses per level; this keeps it far from any thread's stack
/// limit (a debug build overflows a 2 MiB stack near 20 levels).
pub const MAX_PREDICATE_NESTING: usize = 12;
/// Most member selections and indexes (`.`, `[`) in a forwarded predicate:
/// the parser recurses per link of a chain (2,000 overflowed a 2 MiB stack), and
/// the judge evaluates no tree deeper than `MAX_PREDICATE_AST_DEPTH`.
pub const MAX_PREDICATE_SELECTS: usize = 96;
/// Most binary operators in a forwarded predicate, for the same reason.
pub const MAX_PREDICATE_OPERATORS: usize = 48;
/// Stack of the broker's async worker threads.
pub const WORKER_STACK_BYTES: usize = 16 * 1024 * 1024;
/// Delegate bodies converted at once (schema compilation, predicate
/// composition), on the service's `convert` threads: never on an async
/// worker, never on the writer.
pub const MAX_CONCURRENT_CONVERSIONS: usize = 8;
/// Signature verifications a Delegate's conversion may cost and still run
/// on the async worker that verified the request's own signature: one, so
/// a new attestation with one signature under one attestor costs what the
/// request's signature did, and skips the hand-off to a converter thread
/// and back (two thread wake-ups on every first delegation to an agent).
/// Anything that could cost more goes to the converters, in the tenant's
/// share.
pub const MAX_INLINE_VERIFICATIONS: usize = 1;
/// Longest a Delegate waits for its body to be converted, queueing
/// included, in ms; past it the caller gets UNAVAILABLE and may retry.
pub const CONVERSION_DEADLINE_MS: u64 = 10_000;
/// Stack of the threads that parse and evaluate CEL (conversion, judges,
/// writer): the parser and evaluator recurse per nesting level.
pub const DEEP_STACK_BYTES: usize = 64 * 1024 * 1024;
/// Longest a completion waits for its judgment, queueing for one of the
/// judge threads included, in ms; past it the delegate is answered
/// UNAVAILABLE (JUDGES_BUSY) and may retry with the same nonce.
pub const JUDGMENT_DEADLINE_MS: u64 = 10_000;

// Audits (docs/design.md, seed 000): named paths, group-by keys.

/// Most paths (directories and files together) taken from one text; bounds
/// the work of matching evidence against named files.
pub const MAX_NAMED_PATHS: usize = 256;
/// Longest named path, in bytes: the same bound as an observed path, so a
/// longer token could never match one.
pub const MAX_NAMED_PATH_BYTES: usize = MAX_OBSERVED_PATH_BYTES;
/// Longest file extension, in characters; long enough for dotfiles such as
/// `.gitattributes`.
pub const MAX_EXTENSION_CHARS: usize = 16;
/// Most `:N` line references stripped from a token (`:line:column`).
pub const MAX_LINE_REFERENCE_PARTS: usize = 2;
/// Most label keys an aggregation may group by.
pub const MAX_GROUP_BY_KEYS: usize = 8;

// Run labels.

/// Most labels on a run.
pub const MAX_LABELS: usize = 16;
/// Longest label key, in bytes.
pub const MAX_LABEL_KEY_BYTES: usize = 64;
/// Longest label value, in bytes.
pub const MAX_LABEL_VALUE_BYTES: usize = 256;

// Error texts.

/// Longest reason an `InputError` carries, in bytes. It travels twice (the
/// status message and the BadRequest detail), percent-encoded up to 3× and
/// base64-encoded 4/3×: 1,024 bytes keep both far below 8 KiB.
pub const MAX_ERROR_REASON_BYTES: usize = 1_024;
/// Most bytes of a client's input quoted back in an error: enough to
/// recognise it, while a huge bad value does not make a huge error.
pub const MAX_ECHOED_INPUT_BYTES: usize = 128;

// Audit answers.

/// Most runs one AggregateAudits call may cover: bounds its work and its
/// memory. Narrow the selector beyond it.
pub const MAX_AGGREGATE_RUNS: u32 = 10_000;
/// Most paths (and conflicts) one ContractAudit names; it carries their
/// counts too. 10,000 observed paths of 1 KiB made an audit too big to send.
pub const MAX_AUDIT_PATHS_REPORTED: usize = 256;
/// Most other contracts one reported conflict names.
pub const MAX_CONFLICT_CONTRACTS_REPORTED: usize = 64;

// Read sessions.

/// Largest session envelope accepted, in bytes: a real one is ~200.
pub const MAX_SESSION_BYTES: usize = 1_024;

// Bounds the service and the store enforce that clients meet (quoted in
// errors.proto or docs/operating.md; `service::error`'s tests hold the quotes).

/// Longest status message, in bytes (see `core::error::MAX_ERROR_REASON_BYTES`).
pub const MAX_STATUS_MESSAGE_BYTES: usize = 1_536;

/// Jobs one tenant may have waiting for a thread at once; more are refused
/// at once rather than queued (each waiter is a caller holding a request).
pub const MAX_WAITING_PER_TENANT: usize = 256;

/// Most rows (contracts, observations, refusals and escalations) one
/// audit read loads: a tree has no size limit, and AggregateAudits reads
/// up to MAX_AGGREGATE_RUNS of them (rows are typically ~100 bytes to a
/// few KiB).
pub const MAX_AUDIT_ROWS: i64 = 1_000_000;

/// Most bytes of envelopes and observed paths one audit read loads: with
/// `MAX_AUDIT_ROWS` alone, a million rows of 1 KiB paths were a gigabyte
/// (16 audits at once took 1.8 GB).
pub const MAX_AUDIT_BYTES: usize = 128 * 1024 * 1024;

/// Attempts of one transaction before its callers are answered
/// UNAVAILABLE (contention): enough for a hot parent shared by a few
/// replicas, bounded so a caller never waits without limit.
pub const MAX_TX_ATTEMPTS: u32 = 10;

/// Judgments of one completion before giving up when host observations
/// keep arriving while it is judged (each makes the last one stale).
pub const MAX_JUDGMENT_ATTEMPTS: usize = 3;

/// Longest a replicated broker's GetBrokerKeys answers from its copy of
/// the shared key registry.
pub const KEYS_MAX_AGE_MS: u64 = 100;

/// Envelope bytes of one ListChildren page: pages of deep contracts went
/// past the 4 MiB response limit as an untyped OUT_OF_RANGE.
pub const CHILDREN_PAGE_BYTES: usize = 1024 * 1024;

/// Longest trace-context header read (`traceparent` is 55 bytes; W3C caps
/// `tracestate` at 512 and `baggage` at 8,192).
pub const MAX_TRACE_HEADER_BYTES: usize = 8_192;

/// Longest chain verified: the deepest policy the broker allows is 64, so
/// a longer "chain" is not one (bounds the work a hostile file can cause).
pub const MAX_CHAIN_CONTRACTS: usize = MAX_DEPTH_CEILING as usize + 1;

/// Most signatures an envelope may carry: bounds verification work per
/// request.
pub const MAX_SIGNATURES: usize = 4;

/// Most tenants one configuration declares (`core::tenant`).
pub const MAX_TENANTS: usize = 10_000;
/// Most keys one tenant lists.
pub const MAX_KEYS_PER_TENANT: usize = 10_000;
/// Longest tenant name, in bytes.
pub const MAX_TENANT_NAME_BYTES: usize = 64;

/// Token endpoint: longest an assertion may live (`exp - now`): a short one bounds how
/// long the replay cache must remember its `jti`.
pub const MAX_ASSERTION_LIFETIME_S: i64 = 300;
/// Bounds on an assertion's `jti`: long enough to be unique when random,
/// short enough to remember many.
pub const MIN_JTI_BYTES: usize = 16;
pub const MAX_JTI_BYTES: usize = 128;
/// Ceiling on a minted token's lifetime (configured in minutes below it).
pub const MAX_TOKEN_LIFETIME_MINUTES: u32 = 60;
/// Longest resource (audience) name accepted, in bytes.
pub const MAX_RESOURCE_BYTES: usize = 1_024;

// Workload identities (`core::identity`).

/// Longest workload identity, in bytes: a SPIFFE ID (the SPIFFE ID
/// standard's §2.3 limit), an OIDC identity (`issuer#subject`) and an
/// identity pattern alike.
pub const MAX_IDENTITY_BYTES: usize = 2_048;
/// Longest SPIFFE trust domain name, in bytes (RFC 3986's bound on a
/// host, quoted by the SPIFFE ID standard's §2.3).
pub const MAX_TRUST_DOMAIN_BYTES: usize = 255;
/// Longest an identity token may still live when presented (`exp - now`),
/// in seconds: a binding lasts no longer than its token, so this bounds
/// how long a stolen token's binding could outlive a revoked workload.
pub const MAX_IDENTITY_TOKEN_LIFETIME_S: i64 = 24 * 3600;
/// Most characters of a refused `alg` quoted back in the error.
pub const MAX_ECHOED_ALGORITHM_CHARS: usize = 32;
/// Longest name a configuration gives a trusted issuer, in bytes.
pub const MAX_ISSUER_NAME_BYTES: usize = 64;
/// Largest workload token BindIdentity reads, in bytes (broker.proto,
/// BindIdentityBody.token).
pub const MAX_IDENTITY_TOKEN_BYTES: usize = 8_192;
