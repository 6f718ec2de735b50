//! Unit tests of `telemetry`: trace headers, sampling, a call's facts on its
//! span, and the span exporter's counts.

use super::*;

fn headers(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
    pairs
        .iter()
        .map(|(k, v)| {
            (
                http::HeaderName::from_static(k),
                http::HeaderValue::from_str(v).expect("header value"),
            )
        })
        .collect()
}

#[test]
fn trace_headers_past_the_limit_are_not_read() {
    use opentelemetry::propagation::Extractor as _;
    let long = "k=".to_owned() + &"v".repeat(MAX_TRACE_HEADER_BYTES);
    let fits = "k=".to_owned() + &"v".repeat(MAX_TRACE_HEADER_BYTES - 2);
    let map = headers(&[("baggage", &long), ("tracestate", &fits)]);
    assert_eq!(Headers(&map).get("baggage"), None);
    assert_eq!(Headers(&map).get("tracestate"), Some(fits.as_str()));
}

#[test]
fn lazy_facts_format_as_their_eager_forms() {
    assert_eq!(Hex(&[0, 0xab, 7]).to_string(), "00ab07");
    assert_eq!(
        KeyId(&[9; 32]).to_string(),
        broker_wire::crypto::key_id(&[9; 32])
    );
    assert_eq!(Outcome("issued", false).to_string(), "issued");
    assert_eq!(Outcome("issued", true).to_string(), "issued (replayed)");
}

#[test]
fn the_callers_trace_is_continued_or_a_trace_started() {
    let id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let sent = headers(&[("traceparent", &format!("00-{id}-00f067aa0ba902b7-01"))]);
    assert_eq!(log_trace_id(None, &extract(&sent)), id);
    // The exported span's id first (the same trace, when it continues).
    let exported = opentelemetry::trace::TraceId::from_bytes([7; 16]);
    assert_eq!(
        log_trace_id(Some(exported), &extract(&sent)),
        "07".repeat(16)
    );
    // Malformed or all-zero: not continued; a fresh id instead.
    for bad in [
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01".to_owned(),
        format!("00-{id}-0000000000000000-01"),
        format!("00-{}-00f067aa0ba902b7-01", &id[..30]),
        "garbage".to_owned(),
    ] {
        let fresh = log_trace_id(None, &extract(&headers(&[("traceparent", &bad)])));
        assert_eq!(fresh.len(), 32, "{bad}");
        assert_ne!(fresh, id, "{bad}");
    }
    assert_ne!(fresh_trace_id(), fresh_trace_id());
}

/// Keeps what it is sent, for the test to read.
#[derive(Clone, Debug, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_sdk::trace::SpanData>>>);

impl opentelemetry_sdk::trace::SpanExporter for Captured {
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.lock().expect("not poisoned").extend(batch);
        Ok(())
    }
}

/// A caller's `traceparent` with flags 00 does not stop the broker's
/// span when the broker's sampler says sample: the span starts a trace
/// of its own, linked to the caller's; a sampled caller's trace is
/// continued; a ratio of 0 samples nothing, whatever the caller says.
#[test]
fn the_broker_samples_not_the_caller() {
    use opentelemetry::trace::{Span as _, TracerProvider as _};
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let with_flags = |flags: &str| {
        extract(&headers(&[(
            "traceparent",
            &format!("00-{caller_trace}-{caller_span}-{flags}"),
        )]))
    };
    let tracer = |ratio: f64| {
        opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_sampler(sampler(ratio))
            .build()
            .tracer("test")
    };
    let all = tracer(1.0);
    let name = "delegation.broker.v1.Broker/Delegate";
    let span = start_call_span(&all, name, "s", "m", &with_flags("00"));
    let own = span.span_context().clone();
    assert!(own.is_sampled(), "flags 00 switched the broker's span off");
    assert_ne!(own.trace_id().to_string(), caller_trace);
    let links = &span.exported_data().expect("recording").links.links;
    assert_eq!(links.len(), 1, "the caller's span is linked");
    assert_eq!(links[0].span_context.span_id().to_string(), caller_span);
    let span = start_call_span(&all, name, "s", "m", &with_flags("01"));
    assert!(span.span_context().is_sampled());
    assert_eq!(span.span_context().trace_id().to_string(), caller_trace);
    let span = start_call_span(&all, name, "s", "m", &opentelemetry::Context::new());
    assert!(span.span_context().is_sampled(), "no caller context");
    let none = tracer(0.0);
    let span = start_call_span(&none, name, "s", "m", &with_flags("01"));
    assert!(
        !span.span_context().is_sampled(),
        "the operator's ratio rules"
    );
}

#[tokio::test]
async fn a_calls_facts_become_typed_attributes_of_its_exported_span() {
    use opentelemetry::Value;
    use opentelemetry::trace::{Status, Tracer as _, TracerProvider as _};
    let captured = Captured::default();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_simple_exporter(captured.clone())
        .build();
    let tracer = provider.tracer("test");
    static COUNTS: SpanCounters = SpanCounters::new();
    let call = Call {
        span: tracer.start("delegation.broker.v1.Broker/Delegate"),
        facts: Facts::default(),
        counts: &COUNTS,
    };
    let issuing: TraceContext = {
        let mut t = [0u8; 25];
        t[..16].copy_from_slice(&[3; 16]);
        t[16..24].copy_from_slice(&[4; 8]);
        t[24] = 1;
        t
    };
    // Outside a call: facts go nowhere, nothing to link from.
    record(Fact::Depth(9));
    assert_eq!(current_trace_context(), None);
    assert!(!recording());
    let own = CALL
        .scope(std::cell::RefCell::new(call), async {
            assert!(recording());
            record(Fact::AgentKey(&[9; 32]));
            record(Fact::ContractId(&[1; 32]));
            record(Fact::ParentId(&[2; 32]));
            record(Fact::RootId(&[5; 32]));
            record(Fact::RootId(&[2; 32])); // the later one stays
            record(Fact::Depth(3));
            record(Fact::Outcome("refused", true));
            record(Fact::RefusedCodes(&[
                "BUDGET_EXCEEDS_PARENT",
                "DEPTH_EXCEEDED",
            ]));
            record(Fact::ContractId(&[7; 5])); // not an id: dropped
            link_to(&issuing);
            let own = current_trace_context().expect("a recording span");
            let _ = CALL.try_with(|c| c.borrow_mut().end(Some(9)));
            own
        })
        .await;
    let spans = captured.0.lock().expect("not poisoned").clone();
    let [span] = spans.as_slice() else {
        panic!("one span: {spans:?}")
    };
    assert_eq!(&own[..16], &span.span_context.trace_id().to_bytes());
    assert_eq!(&own[16..24], &span.span_context.span_id().to_bytes());
    let attribute = |key: &str| {
        span.attributes
            .iter()
            .find(|a| a.key.as_str() == key)
            .map(|a| a.value.clone())
    };
    let string = |s: String| Some(Value::String(s.into()));
    assert_eq!(attribute("rpc.grpc.status_code"), Some(Value::I64(9)));
    assert_eq!(attribute("broker.contract_id"), None);
    assert_eq!(attribute("broker.parent_id"), string("02".repeat(32)));
    assert_eq!(attribute("broker.root_id"), string("02".repeat(32)));
    assert_eq!(attribute("broker.depth"), Some(Value::I64(3)));
    assert_eq!(
        attribute("broker.agent_key_id"),
        string(broker_wire::crypto::key_id(&[9; 32]))
    );
    assert_eq!(
        attribute("broker.outcome"),
        string("refused (replayed)".into())
    );
    assert_eq!(
        attribute("broker.refused_codes"),
        string("BUDGET_EXCEEDS_PARENT,DEPTH_EXCEEDED".into())
    );
    assert_eq!(span.status, Status::error(""));
    let links: Vec<_> = span.links.iter().map(|l| l.span_context.clone()).collect();
    assert_eq!(links.len(), 1);
    assert_eq!(links[0].trace_id().to_bytes(), [3; 16]);
    assert_eq!(links[0].span_id().to_bytes(), [4; 8]);
}

/// Fails every export, like a collector that is away.
#[derive(Debug)]
struct Away;

impl opentelemetry_sdk::trace::SpanExporter for Away {
    async fn export(
        &self,
        _batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
            "away".into(),
        ))
    }
}

#[tokio::test]
async fn the_exporter_counts_spans_ended_exported_and_failed() {
    use opentelemetry::trace::{Tracer as _, TracerProvider as _};
    // This test's own counters: exact, whatever else runs.
    static COUNTS: SpanCounters = SpanCounters::new();
    for away in [false, true] {
        let provider = if away {
            opentelemetry_sdk::trace::SdkTracerProvider::builder()
                .with_simple_exporter(Counted {
                    inner: Away,
                    counts: &COUNTS,
                })
                .build()
        } else {
            opentelemetry_sdk::trace::SdkTracerProvider::builder()
                .with_simple_exporter(Counted {
                    inner: Captured::default(),
                    counts: &COUNTS,
                })
                .build()
        };
        let tracer = provider.tracer("test");
        // One call answered, one dropped before its answer (the client
        // went away): both spans end, once each.
        let mut answered = Call {
            span: tracer.start("answered"),
            facts: Facts::default(),
            counts: &COUNTS,
        };
        answered.end(Some(0));
        drop(answered);
        drop(Call {
            span: tracer.start("dropped"),
            facts: Facts::default(),
            counts: &COUNTS,
        });
    }
    assert_eq!(
        COUNTS.snapshot(),
        SpanCounts {
            ended: 4,
            exported: 2,
            failed: 2
        }
    );
}

mod otel_variables {
    use crate::telemetry::{Protocol, Sampling, export_settings, resource};

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn no_endpoint_no_export_and_the_sdk_can_be_disabled() {
        assert_eq!(export_settings(None, None, env(&[])).unwrap(), None);
        let vars = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_SDK_DISABLED", "true"),
        ];
        assert_eq!(export_settings(None, None, env(&vars)).unwrap(), None);
    }

    #[test]
    fn the_traces_endpoint_wins_and_http_gets_its_path() {
        let grpc = export_settings(Some("http://c:4317"), None, env(&[]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (grpc.endpoint.as_str(), grpc.protocol),
            ("http://c:4317", Protocol::Grpc)
        );
        assert_eq!(grpc.sampling, Sampling::Ratio(1.0));
        let vars = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ];
        let http = export_settings(None, None, env(&vars)).unwrap().unwrap();
        assert_eq!(http.endpoint, "http://c:4318/v1/traces");
        assert_eq!(http.protocol, Protocol::HttpProtobuf);
        let vars = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:9/x"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ];
        let traces = export_settings(Some("http://flag:4317"), None, env(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(traces.endpoint, "http://t:9/x", "used as given");
        assert_eq!(traces.protocol, Protocol::HttpProtobuf);
        let bad = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ];
        let error = export_settings(None, None, env(&bad)).unwrap_err();
        assert!(
            error.to_string().contains("OTEL_EXPORTER_OTLP_PROTOCOL"),
            "{error}"
        );
    }

    #[test]
    fn samplers_by_name_and_the_flag_wins() {
        let with = |sampler: &str, arg: &str| {
            let vars = [
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
                ("OTEL_TRACES_SAMPLER", sampler),
                ("OTEL_TRACES_SAMPLER_ARG", arg),
            ];
            export_settings(None, None, env(&vars)).map(|e| e.unwrap().sampling)
        };
        assert_eq!(with("always_off", "").unwrap(), Sampling::Ratio(0.0));
        assert_eq!(with("traceidratio", "0.25").unwrap(), Sampling::Ratio(0.25));
        assert_eq!(
            with("parentbased_traceidratio", "0.5").unwrap(),
            Sampling::ParentBased(0.5)
        );
        assert_eq!(
            with("parentbased_always_on", "").unwrap(),
            Sampling::ParentBased(1.0)
        );
        assert!(with("traceidratio", "2").is_err());
        assert!(with("jaeger_remote", "").is_err());
        let vars = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
            ("OTEL_TRACES_SAMPLER", "always_off"),
        ];
        let flag = export_settings(None, Some(0.5), env(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(flag.sampling, Sampling::Ratio(0.5));
    }

    #[test]
    fn the_resource_names_the_broker_its_version_and_instance() {
        let read = |r: &opentelemetry_sdk::Resource, key: &str| {
            r.get(&opentelemetry::Key::from(key.to_owned()))
                .map(|v| v.to_string())
        };
        let plain = resource(env(&[]));
        assert_eq!(
            read(&plain, "service.name").as_deref(),
            Some("delegation-broker")
        );
        assert_eq!(
            read(&plain, "service.version").as_deref(),
            Some(env!("CARGO_PKG_VERSION"))
        );
        let instance = read(&plain, "service.instance.id").unwrap();
        assert_eq!(instance.len(), 36);
        assert_ne!(
            read(&resource(env(&[])), "service.instance.id").unwrap(),
            instance
        );
        // What the operator says is kept; OTEL_SERVICE_NAME wins.
        let given = resource(env(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "service.name=x, service.instance.id=pod-7,deployment.environment=prod",
        )]));
        assert_eq!(
            read(&given, "service.instance.id").as_deref(),
            Some("pod-7")
        );
        assert_eq!(read(&given, "service.name").as_deref(), Some("x"));
        assert_eq!(
            read(&given, "deployment.environment").as_deref(),
            Some("prod")
        );
        let named = resource(env(&[
            ("OTEL_RESOURCE_ATTRIBUTES", "service.name=x"),
            ("OTEL_SERVICE_NAME", "y"),
        ]));
        assert_eq!(read(&named, "service.name").as_deref(), Some("y"));
    }
}

#[test]
fn a_throttle_lets_one_line_through_and_counts_the_rest() {
    let throttle = crate::telemetry::Throttle::new();
    assert_eq!(throttle.allow(), Some(0), "the first line is written");
    // Within the interval: held back and counted (these calls take far
    // less than LOG_THROTTLE_MS).
    assert_eq!(throttle.allow(), None);
    assert_eq!(throttle.allow(), None);
    // Once the interval has passed, the next line says how many were held.
    std::thread::sleep(std::time::Duration::from_millis(
        crate::telemetry::LOG_THROTTLE_MS + 50,
    ));
    assert_eq!(throttle.allow(), Some(2));
    assert_eq!(throttle.allow(), None);
}

#[test]
fn delegation_broker_names_every_crate_of_the_workspace() {
    let expanded = whole_family("info,delegation_broker=debug");
    assert!(
        expanded.starts_with("info,delegation_broker=debug,"),
        "{expanded}"
    );
    for krate in FAMILY {
        assert!(expanded.contains(&format!("{krate}=debug")), "{expanded}");
    }
    // A module of it, or another crate, is left as written.
    assert_eq!(
        whole_family("warn,delegation_broker::server=info,tonic=debug"),
        "warn,delegation_broker::server=info,tonic=debug"
    );
    assert!(EnvFilter::try_new(whole_family("delegation_broker")).is_ok());
}
