//! Concurrent siblings can never overspend their parent; connections are
//! capped.

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_siblings_of_ten_from_three_hundred_issue_exactly_thirty() {
    let mut broker = Broker::start().await;
    let addr = broker.addr.clone();
    assert_siblings_never_overspend(&mut broker, &[addr]).await;
    broker.stop().await;
}

/// With `limits.max_connections` connections open, the next client is not
/// served (it waits to be accepted) until one of them closes; then it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_wait_until_one_closes() {
    use delegation_broker::pb;
    use delegation_broker::pb::broker_client::BrokerClient;
    use std::time::Duration;
    // The harness's own client is the first connection.
    let mut broker = Broker::start_with(|config| config.limits.max_connections = 2).await;
    broker.keys().await;
    let client = |addr: String| async move {
        let channel = tonic::transport::Endpoint::from_shared(addr)
            .unwrap()
            .timeout(Duration::from_millis(500))
            .connect_lazy();
        BrokerClient::new(channel)
    };
    let keys = |mut client: BrokerClient<tonic::transport::Channel>| async move {
        client
            .get_broker_keys(pb::GetBrokerKeysRequest::default())
            .await
            .map(|_| client)
    };
    let second = keys(client(broker.addr.clone()).await)
        .await
        .expect("the second connection is served");
    let third = client(broker.addr.clone()).await;
    let third = match keys(third.clone()).await {
        Err(status) => {
            assert!(
                matches!(
                    status.code(),
                    tonic::Code::Cancelled
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Unavailable
                ),
                "{status:?}"
            );
            third
        }
        Ok(_) => panic!("a third connection was served beyond max_connections = 2"),
    };
    drop(second);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match keys(third.clone()).await {
            Ok(_) => break,
            Err(status) => assert!(
                tokio::time::Instant::now() < deadline,
                "the third connection was never served after one closed: {status:?}"
            ),
        }
    }
    broker.stop().await;
}
