//! What operators and tools see from outside: reflection in both versions.

use tonic_reflection::pb::{v1, v1alpha};

use crate::harness::Broker;

/// The services a reflection client lists.
#[tokio::test]
async fn reflection_lists_the_services_in_v1_and_v1alpha() {
    let broker = Broker::start().await;
    let channel = tonic::transport::Endpoint::from_shared(broker.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();

    let mut alpha = v1alpha::server_reflection_client::ServerReflectionClient::new(channel.clone());
    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    let mut answers = alpha
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("v1alpha is served")
        .into_inner();
    let answer = answers.message().await.unwrap().expect("an answer");
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        answer.message_response
    else {
        panic!("not a service list: {answer:?}");
    };
    let alpha_names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();

    let mut current = v1::server_reflection_client::ServerReflectionClient::new(channel);
    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let mut answers = current
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("v1 is served")
        .into_inner();
    let answer = answers.message().await.unwrap().expect("an answer");
    let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        answer.message_response
    else {
        panic!("not a service list: {answer:?}");
    };
    let v1_names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();

    for names in [&alpha_names, &v1_names] {
        for service in ["delegation.broker.v1.Broker", "grpc.health.v1.Health"] {
            assert!(names.iter().any(|n| n == service), "{service} in {names:?}");
        }
    }
    broker.stop().await;
}

/// Health tells the truth: a broker whose store can no longer make writes
/// durable answers NOT_SERVING, for the broker's service and overall.
#[tokio::test]
async fn a_failed_fsync_turns_health_not_serving() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let mut broker = Broker::start().await;
    let channel = tonic::transport::Endpoint::from_shared(broker.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let status = |service: &str| HealthCheckRequest {
        service: service.into(),
    };
    for service in ["", "delegation.broker.v1.Broker"] {
        let answer = health.check(status(service)).await.unwrap().into_inner();
        assert_eq!(answer.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let orchestrator = delegation_broker::client::Agent::generate();
    broker
        .open_root(&orchestrator, crate::harness::RootSpec::default())
        .await;
    // The fault, from outside: the write-ahead log's path disappears, so
    // the next fsync of it fails (the store stops for good, by design).
    std::fs::remove_file(broker.data_dir().join("broker.sqlite3-wal")).unwrap();
    let failed = broker
        .client
        .open_root(orchestrator.open_root(crate::harness::RootSpec::default().body()))
        .await;
    assert!(
        failed.is_err(),
        "a write after the fault is not durable: {failed:?}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    for service in ["", "delegation.broker.v1.Broker"] {
        loop {
            let answer = health.check(status(service)).await.unwrap().into_inner();
            if answer.status == ServingStatus::NotServing as i32 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{service:?} still serving"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    broker.stop().await;
}
