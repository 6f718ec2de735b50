//! What `bench --telemetry` adds to the in-process broker: an OTLP
//! receiver its spans are exported to, and a scraper of its metrics.

use std::sync::Arc;
use std::time::Duration;

/// An OTLP trace receiver that counts and drops what it is sent.
pub(super) struct SpanSink {
    pub(super) endpoint: String,
    pub(super) spans: Arc<std::sync::atomic::AtomicU64>,
}

impl SpanSink {
    pub(super) async fn start() -> anyhow::Result<Self> {
        use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
            TraceService, TraceServiceServer,
        };
        use opentelemetry_proto::tonic::collector::trace::v1::{
            ExportTraceServiceRequest, ExportTraceServiceResponse,
        };

        struct Counter(Arc<std::sync::atomic::AtomicU64>);

        #[tonic::async_trait]
        impl TraceService for Counter {
            async fn export(
                &self,
                request: tonic::Request<ExportTraceServiceRequest>,
            ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
                let spans: usize = request
                    .into_inner()
                    .resource_spans
                    .iter()
                    .flat_map(|r| &r.scope_spans)
                    .map(|s| s.spans.len())
                    .sum();
                self.0
                    .fetch_add(spans as u64, std::sync::atomic::Ordering::Relaxed);
                Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
            }
        }

        let spans = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(Counter(spans.clone())))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok(Self { endpoint, spans })
    }
}

/// What a Prometheus server does to a target, a little more often.
pub(super) async fn scrape_every_second(address: std::net::SocketAddr) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Ok(mut stream) = tokio::net::TcpStream::connect(address).await else {
            continue;
        };
        if stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            .await
            .is_ok()
        {
            let mut sink = Vec::new();
            let _ = stream.read_to_end(&mut sink).await;
        }
    }
}
