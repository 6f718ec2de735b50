//! The per-delegation CPU work of the broker outside gRPC and SQLite, piece
//! by piece: what the load generator's end-to-end number (BENCHMARKS.md) is
//! made of. Run with `cargo bench --bench hot_path`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use delegation_broker::command::{HopTrust, NewChild, NewRoot, RequestMeta};
use delegation_broker::core::{
    ChildAsk, Completion, Ledger, Liability, Observed, ParentView, Policy, Predicate, Scope,
    Status, check_delegation, judge,
};
use delegation_broker::crypto::{self, payload_type};
use delegation_broker::pb;
use delegation_broker::stamp::Stamper;
use delegation_broker::store::recent::RecentRequests;

/// A request payload about the size of the load generator's Delegate.
const REQUEST_BYTES: usize = 420;
/// The load generator's chain depth (the target).
const DEPTH: u32 = 8;
const PREDICATE: &str = "result.schema_valid && result.within_scope";

fn policy() -> Policy {
    Policy {
        max_depth: 16,
        min_cumulative_trust_ppm: 0,
        max_children: 64,
        retry_headroom: true,
        require_host: false,
    }
}

fn request(agent: u8, nonce: u64) -> RequestMeta {
    RequestMeta {
        agent: [agent; 32],
        nonce: nonce.to_be_bytes().to_vec(),
        digest: [agent; 32],
        timestamp_ms: 1_000,
    }
}

fn ask(requester: u8, lineage: [u8; 32]) -> ChildAsk {
    ChildAsk {
        requester: [requester; 32],
        intent_lineage_hash: lineage,
        budget: 10,
        deadline_ms: None,
        liability: Liability::Delegate,
        predicate: Predicate::parse(PREDICATE, "predicate").expect("predicate"),
        escalation_channel: "ops".into(),
        min_retry_cost: 0,
        min_retry_latency_ms: 0,
        write_scope: Scope::parse(&["src/".to_owned()], "write_scope").expect("scope"),
        factor_ppm: 990_000,
        factor_note: String::new(),
    }
}

fn signatures(c: &mut Criterion) {
    let key = crypto::generate_signing_key();
    let public = key.verifying_key();
    let payload = vec![7u8; REQUEST_BYTES];
    let envelope = crypto::sign_envelope(&key, payload_type::DELEGATE, payload.clone());
    c.bench_function("sign_envelope (one broker signature)", |b| {
        b.iter(|| crypto::sign_envelope(&key, payload_type::DELEGATE, black_box(payload.clone())))
    });
    let public_bytes = public.to_bytes();
    c.bench_function(
        "decode a public key (first time: point decompression)",
        |b| b.iter(|| ed25519_dalek::VerifyingKey::from_bytes(black_box(&public_bytes))),
    );
    c.bench_function("public_key (a key decoded before: the memo)", |b| {
        b.iter(|| crypto::public_key(black_box(&public_bytes)))
    });
    c.bench_function("verify_envelope (the request's signature)", |b| {
        b.iter(|| crypto::verify_envelope(black_box(&envelope), payload_type::DELEGATE, &public))
    });
}

fn stamping(c: &mut Criterion) {
    let stamper = Stamper::new(crypto::generate_signing_key());
    let root = NewRoot {
        identity: None,
        request: request(1, 0),
        intent: "answer once".into(),
        task: String::new(),
        budget: 1_000,
        deadline_ms: i64::MAX / 2,
        policy: policy(),
        predicate: Predicate::default(),
        write_scope: Scope::parse(&["src/".to_owned()], "write_scope").expect("scope"),
        labels: Default::default(),
        trace: None,
    };
    let lineage = crypto::sha256(root.intent.as_bytes());
    // A parent at depth DEPTH - 1 (a child's stamp no longer depends on
    // its ancestors, but the bench keeps its depth-8 name and shape).
    let mut parent = stamper.root(&root, 1_000);
    for depth in 1..DEPTH {
        let child = new_child(parent.stamped.id, depth as u8, lineage);
        let terms = terms(depth, lineage);
        parent = stamper.child(&lineage, &child, &terms, 1_000);
    }
    let child = new_child(parent.stamped.id, DEPTH as u8, lineage);
    let terms = terms(DEPTH, lineage);
    c.bench_function("stamp a depth-8 child (one signed contract)", |b| {
        b.iter(|| stamper.child(black_box(&lineage), &child, &terms, 1_000))
    });
}

fn new_child(parent_id: [u8; 32], asker: u8, lineage: [u8; 32]) -> NewChild {
    NewChild {
        identity: None,
        request: request(asker, 1),
        parent_id,
        ask: ask(asker, lineage),
        task: "plan".into(),
        delegate_key: [asker.wrapping_add(1); 32],
        trust: HopTrust {
            source: pb::TrustSource::Attestation,
            attestation_digest: Some([3; 32]),
            risk_class: "standard".into(),
        },
        host: None,
        result_schema_json: String::new(),
        trace: None,
    }
}

fn terms(depth: u32, lineage: [u8; 32]) -> delegation_broker::core::ChildTerms {
    let parent = parent_view(depth - 1, lineage);
    check_delegation(&parent, &ask(0, lineage), 1_000).expect("admissible")
}

fn parent_view(depth: u32, lineage: [u8; 32]) -> ParentView {
    ParentView {
        ending: false,
        status: Status::Accepted,
        delegate_key: [0; 32],
        depth,
        intent_lineage_hash: lineage,
        cumulative_trust_ppm: 1_000_000,
        liability: Liability::Delegate,
        effective_predicate: Predicate::parse(PREDICATE, "predicate").expect("predicate"),
        deadline_ms: i64::MAX / 2,
        write_scope: Scope::parse(&["src/".to_owned()], "write_scope").expect("scope"),
        policy: policy(),
        ledger: Ledger {
            budget: 1_000,
            reserved: 100,
            spent: 0,
            open_children: 3,
        },
    }
}

fn invariants(c: &mut Criterion) {
    let lineage = crypto::sha256(b"answer once");
    let parent = parent_view(DEPTH - 1, lineage);
    let ask = ask(0, lineage);
    c.bench_function("check_delegation (all fifteen invariants)", |b| {
        b.iter(|| check_delegation(black_box(&parent), black_box(&ask), 1_000))
    });
    // A new text every time (the memo only adds an insert; it is cleared
    // when full, like a cold one).
    let mut n = 0u64;
    c.bench_function("parse a CEL predicate (first time)", |b| {
        b.iter(|| {
            n += 1;
            Predicate::parse(&format!("{PREDICATE} && result.n != {n}"), "predicate")
        })
    });
    c.bench_function(
        "parse a CEL predicate (a text parsed before: the memo)",
        |b| b.iter(|| Predicate::parse(black_box(PREDICATE), "predicate")),
    );
}

fn judgment(c: &mut Criterion) {
    let scope = Scope::parse(&["out/".to_owned()], "write_scope").expect("a scope");
    let completion = Completion {
        output: serde_json::json!({"summary": "done", "files": ["out/report.md"]}),
        claim: "success".to_owned(),
        reported_consumed: 3,
        has_report: true,
        schema: None,
    };
    let observed = Observed {
        tool_calls: 2,
        mutation_paths: vec!["out/report.md".to_owned()],
        consumed_by_host: Some(3),
        elapsed_ms: 40,
    };
    c.bench_function("judge a completion (a predicate of two conjuncts)", |b| {
        b.iter(|| judge(black_box(PREDICATE), &scope, &completion, &observed))
    });
}

fn recent_requests(c: &mut Criterion) {
    // The default window: the filters at their production size.
    let mut recent = RecentRequests::new(300_000, 0);
    let mut nonce = 0u64;
    c.bench_function("recent-request set: probe + insert", |b| {
        b.iter(|| {
            nonce += 1;
            let key = nonce.to_be_bytes();
            let seen = recent.may_contain(&[5; 32], &key, 1_000_000);
            recent.insert(&[5; 32], &key, 1_000_000);
            seen
        })
    });
}

criterion_group!(
    hot_path,
    signatures,
    stamping,
    invariants,
    judgment,
    recent_requests
);
criterion_main!(hot_path);
