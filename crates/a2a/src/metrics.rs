//! The A2A gateway's own Prometheus metrics (`metrics_listen`, `GET
//! /metrics`): tasks admitted, refusals by side and reason, the broker
//! calls it makes for the agent, and the latency of the agent and peers.
//! Label values come from fixed lists; a reason outside the broker's
//! spelling (upper case and `_`) counts as `OTHER`.

use prometheus::{
    Encoder as _, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// Buckets of the upstream latency, in seconds.
const LATENCY_BUCKETS_S: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0,
];
/// Longest reason kept as a label value.
const MAX_REASON_LABEL: usize = 40;

/// Which side of the gateway answered.
#[derive(Clone, Copy, Debug)]
pub enum Side {
    Ingress,
    Egress,
    Authz,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Ingress => "ingress",
            Side::Egress => "egress",
            Side::Authz => "authz",
        }
    }
}

pub struct GatewayMetrics {
    registry: Registry,
    pub admitted: IntCounter,
    refused: IntCounterVec,
    broker_calls: IntCounterVec,
    upstream: HistogramVec,
    pub followed: IntGauge,
    pub watched: IntCounter,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl GatewayMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let admitted = IntCounter::new(
            "a2a_gateway_tasks_admitted_total",
            "Tasks admitted under a contract (ingress) or allowed (authz).",
        )
        .expect("valid metric");
        let refused = IntCounterVec::new(
            Opts::new(
                "a2a_gateway_refused_total",
                "Requests answered with an error, by side and reason (the broker's ErrorReason or invariant code).",
            ),
            &["side", "reason"],
        )
        .expect("valid metric");
        let broker_calls = IntCounterVec::new(
            Opts::new(
                "a2a_gateway_broker_calls_total",
                "Calls made to the broker for the agent, by call and outcome (ok, refused, error).",
            ),
            &["call", "outcome"],
        )
        .expect("valid metric");
        let upstream = HistogramVec::new(
            HistogramOpts::new(
                "a2a_gateway_upstream_seconds",
                "Latency of A2A calls to the fronted agent and to peers, by method.",
            )
            .buckets(LATENCY_BUCKETS_S.to_vec()),
            &["method"],
        )
        .expect("valid metric");
        let followed = IntGauge::new(
            "a2a_gateway_tasks_followed",
            "Tasks the ingress follows now (polling the agent).",
        )
        .expect("valid metric");
        let watched = IntCounter::new(
            "a2a_gateway_contracts_watched_total",
            "Contracts of followed tasks the ingress asked its WatchContracts stream to add (a task its first read finds settled is not asked for; a reopened stream adds every followed one again, uncounted).",
        )
        .expect("valid metric");
        for metric in [
            Box::new(admitted.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(refused.clone()),
            Box::new(broker_calls.clone()),
            Box::new(upstream.clone()),
            Box::new(followed.clone()),
            Box::new(watched.clone()),
        ] {
            registry.register(metric).expect("unique metric names");
        }
        // Series present from the start, so dashboards read 0.
        for call in [
            "accept", "complete", "escalate", "decline", "delegate", "revoke",
        ] {
            for outcome in ["ok", "refused", "error"] {
                broker_calls.with_label_values(&[call, outcome]);
            }
        }
        for method in ["SendMessage", "GetTask", "CancelTask"] {
            upstream.with_label_values(&[method]);
        }
        Self {
            registry,
            admitted,
            refused,
            broker_calls,
            upstream,
            followed,
            watched,
        }
    }

    pub fn refused(&self, side: Side, reason: &str) {
        let plain = !reason.is_empty()
            && reason.len() <= MAX_REASON_LABEL
            && reason.bytes().all(|b| b.is_ascii_uppercase() || b == b'_');
        let reason = if plain { reason } else { "OTHER" };
        self.refused
            .with_label_values(&[side.label(), reason])
            .inc();
    }

    /// A broker call's outcome: `refused` for a Delegate the broker
    /// refused, `error` for an error status.
    pub fn broker_call(&self, call: &'static str, outcome: &'static str) {
        self.broker_calls.with_label_values(&[call, outcome]).inc();
    }

    pub fn upstream(&self, method: &str, seconds: f64) {
        let method = match method {
            "SendMessage" | "GetTask" | "CancelTask" => method,
            _ => "other",
        };
        self.upstream.with_label_values(&[method]).observe(seconds);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_outside_the_spelling_count_as_other() {
        let metrics = GatewayMetrics::new();
        metrics.refused(Side::Ingress, "NOT_DELEGATE");
        metrics.refused(Side::Egress, "a\nforged label");
        let text = metrics.render();
        assert!(
            text.contains(r#"a2a_gateway_refused_total{reason="NOT_DELEGATE",side="ingress"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"a2a_gateway_refused_total{reason="OTHER",side="egress"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"a2a_gateway_broker_calls_total{call="accept",outcome="ok"} 0"#));
    }
}
