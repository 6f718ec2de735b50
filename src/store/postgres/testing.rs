//! Databases for tests: each test creates its own on the throwaway server
//! the test command starts (`scripts/pg.sh`), so tests never touch a
//! database they did not create.

use sqlx::Connection;

/// The variable naming the throwaway server's maintenance database.
pub const TEST_SERVER_VAR: &str = "BROKER_TEST_POSTGRES_URL";

/// A fresh, empty database of its own, dropped (best effort) when this is.
pub struct TestDatabase {
    /// `postgres://…/broker_test_…`: pass to `--database-url`.
    pub url: String,
    admin: String,
    name: String,
}

impl TestDatabase {
    /// Creates the database. Panics, saying how to get a server, when the
    /// test command's server is not there: a PostgreSQL test that cannot
    /// reach PostgreSQL must fail, not pass unseen.
    pub async fn create() -> Self {
        let admin = std::env::var(TEST_SERVER_VAR).unwrap_or_else(|_| {
            panic!(
                "{TEST_SERVER_VAR} is not set: PostgreSQL tests run through the README's test \
                 command (scripts/test.sh), which starts a throwaway server; to run them alone, \
                 `d=$(mktemp -d); eval \"$(scripts/pg.sh start $d)\"` first"
            )
        });
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes).expect("random database name");
        let name = format!("broker_test_{}", hex::encode(bytes));
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("connecting to {admin}: {e}"));
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        let _ = conn.close().await;
        let base = admin
            .rsplit_once('/')
            .map_or(admin.as_str(), |(base, _)| base);
        Self {
            url: format!("{base}/{name}"),
            admin,
            name,
        }
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let (admin, name) = (self.admin.clone(), self.name.clone());
        // Drop runs inside the test's runtime: a thread of its own.
        let dropped = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                if let Ok(mut conn) = sqlx::PgConnection::connect(&admin).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await;
                    let _ = conn.close().await;
                }
            });
        });
        let _ = dropped.join();
    }
}
