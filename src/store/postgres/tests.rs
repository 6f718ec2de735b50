//! The store suite (`store::suite`) against PostgreSQL, each test on a
//! database of its own.

use super::*;
use crate::clock::SystemClock;
use crate::store::postgres::testing::TestDatabase;

pub(super) fn test_stamper() -> Arc<Stamper> {
    Arc::new(Stamper::new(ed25519_dalek::SigningKey::from_bytes(
        &[1u8; 32],
    )))
}

pub(super) fn test_options(url: &str) -> PostgresOptions {
    let mut options = PostgresOptions::new(url);
    options.read_connections = 2;
    options.writers = 2;
    options.queue_depth = 256;
    options.max_batch = 16;
    options.request_log_retention_ms = i64::MAX;
    options
}

async fn open_suite_store() -> (PostgresStore, TestDatabase) {
    let database = TestDatabase::create().await;
    let store = PostgresStore::open(
        test_options(&database.url),
        test_stamper(),
        Arc::new(SystemClock),
    )
    .await
    .expect("open");
    (store, database)
}

crate::store::suite::store_suite!(suite, super::open_suite_store);
