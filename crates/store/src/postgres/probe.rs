//! The floor under a replica's durable answers: one caller's plain
//! one-row commits on the server (`bench --latency --database`), the
//! PostgreSQL counterpart of `disk-probe`.

use std::time::{Duration, Instant};

use sqlx::Connection as _;

use crate::StoreError;

/// One caller's one-row commits on the database at `url` for `duration`,
/// in a table of its own dropped after: each commit's latency, sorted, µs.
pub async fn one_row_commits(url: &str, duration: Duration) -> Result<Vec<u32>, StoreError> {
    let failed = |e: sqlx::Error| StoreError::Backend(format!("the commit probe: {e}"));
    let mut conn = sqlx::PgConnection::connect(url).await.map_err(failed)?;
    sqlx::query("CREATE TABLE broker_commit_probe (n bigint PRIMARY KEY)")
        .execute(&mut conn)
        .await
        .map_err(failed)?;
    let mut us = Vec::new();
    let stop_at = Instant::now() + duration;
    let mut n = 0i64;
    while Instant::now() < stop_at {
        let began = Instant::now();
        sqlx::query("INSERT INTO broker_commit_probe (n) VALUES ($1)")
            .bind(n)
            .execute(&mut conn)
            .await
            .map_err(failed)?;
        us.push(u32::try_from(began.elapsed().as_micros()).unwrap_or(u32::MAX));
        n += 1;
    }
    sqlx::query("DROP TABLE broker_commit_probe")
        .execute(&mut conn)
        .await
        .map_err(failed)?;
    us.sort_unstable();
    Ok(us)
}
