//! Databases for tests: each test creates its own on the throwaway server
//! the test command starts (`scripts/pg.sh`), so tests never touch a
//! database they did not create. A test that needs the schema clones a
//! template migrated once per set of migrations (`TestDatabase::migrated`)
//! instead of running every migration again.

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
    /// Creates an empty database. Panics, saying how to get a server, when
    /// the test command's server is not there: a PostgreSQL test that
    /// cannot reach PostgreSQL must fail, not pass unseen.
    pub async fn create() -> Self {
        Self::create_from(None).await
    }

    /// Creates a database holding every migration, cloned from a template
    /// migrated once per set of migrations on this server (each test runs
    /// in a process of its own: the template is made under a temporary
    /// name and renamed into place, so concurrent tests race safely).
    pub async fn migrated() -> Self {
        let admin = admin_url();
        let template = template_name();
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("connecting to {admin}: {e}"));
        let exists: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
                .bind(&template)
                .fetch_optional(&mut conn)
                .await
                .expect("look up the template database");
        let _ = conn.close().await;
        if exists.is_none() {
            let scratch = Self::create_from(None).await;
            let connect = super::connect_options(&scratch.url).expect("test database URL");
            super::migrate::run(&connect)
                .await
                .expect("migrate the template database");
            let mut conn = sqlx::PgConnection::connect(&admin)
                .await
                .unwrap_or_else(|e| panic!("connecting to {admin}: {e}"));
            // Another test may have renamed its copy into place first:
            // then this one is dropped with `scratch`.
            let renamed = sqlx::query(sqlx::AssertSqlSafe(format!(
                "ALTER DATABASE {} RENAME TO {template}",
                scratch.name
            )))
            .execute(&mut conn)
            .await;
            let _ = conn.close().await;
            if renamed.is_ok() {
                std::mem::forget(scratch);
            }
        }
        Self::create_from(Some(&template)).await
    }

    async fn create_from(template: Option<&str>) -> Self {
        let admin = admin_url();
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes).expect("random database name");
        let name = format!("broker_test_{}", hex::encode(bytes));
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("connecting to {admin}: {e}"));
        let create = match template {
            Some(template) => format!("CREATE DATABASE {name} TEMPLATE {template}"),
            None => format!("CREATE DATABASE {name}"),
        };
        // A clone fails while another session is still connected to its
        // template (one that just made it, briefly): retried.
        let mut attempt = 0;
        loop {
            match sqlx::query(sqlx::AssertSqlSafe(create.clone()))
                .execute(&mut conn)
                .await
            {
                Ok(_) => break,
                Err(e) if attempt < CREATE_ATTEMPTS => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "creating a test database again");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(e) => panic!("create the test database: {e}"),
            }
        }
        let _ = conn.close().await;
        let base = admin
            .rsplit_once('/')
            .map_or(admin.as_str(), |(base, _)| base);
        let database = Self {
            url: format!("{base}/{name}"),
            admin,
            name,
        };
        if template.is_some() {
            // A clone has its template's cursor tag: each database gets
            // its own, as migrating it would have given (cursors from
            // another database must be refused).
            let mut conn = sqlx::PgConnection::connect(&database.url)
                .await
                .unwrap_or_else(|e| panic!("connecting to {}: {e}", database.url));
            sqlx::query(
                "UPDATE event_clock SET tag = 1 + floor(random() * 32767)::BIGINT WHERE id = 1",
            )
            .execute(&mut conn)
            .await
            .expect("a tag of its own");
            let _ = conn.close().await;
        }
        database
    }
}

/// Tries of one `CREATE DATABASE` (see `create_from`).
const CREATE_ATTEMPTS: u32 = 100;

/// The throwaway server's maintenance database.
fn admin_url() -> String {
    std::env::var(TEST_SERVER_VAR).unwrap_or_else(|_| {
        panic!(
            "{TEST_SERVER_VAR} is not set: PostgreSQL tests run through the README's test \
             command (scripts/test.sh), which starts a throwaway server; to run them alone, \
             `d=$(mktemp -d); eval \"$(scripts/pg.sh start $d)\"` first"
        )
    })
}

/// The template's name: a digest of every migration's version and
/// checksum, so a changed migration gets a template of its own.
fn template_name() -> String {
    use sha2::Digest;
    let mut digest = sha2::Sha256::new();
    for migration in super::migrate::migrator().iter() {
        digest.update(migration.version.to_be_bytes());
        digest.update(&migration.checksum);
    }
    format!("broker_template_{}", hex::encode(&digest.finalize()[..8]))
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
